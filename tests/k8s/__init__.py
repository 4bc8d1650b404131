"""The Kubernetes deployment under k8s/, checked offline: no cluster, no Docker engine.

`kubectl kustomize` renders the manifests exactly as `kubectl apply -k` would send them:
the base k8s/ (the `base` fixture in conftest.py), and an overlay of it with every
optional component of k8s/components/ (`rendered`), or with another namespace
(manifests.py); each module checks one subject of what it renders. Schemas cannot see
what ties the objects together, so most of the checks are of the properties that could
drift without any tool noticing.
"""
