"""The Kubernetes deployment under k8s/, checked offline: no cluster, no Docker engine.

`kubectl kustomize k8s/` renders the manifests exactly as `kubectl apply -k k8s/` would
send them (manifests.py, and the `rendered` fixture in conftest.py); each module checks one
subject of what it renders. Schemas cannot see what ties the objects together, so most of
the checks are of the properties that could drift without any tool noticing.
"""
