"""Kubernetes as a source: list + watch of any kind, Events, and the client they share."""

from xds_server.sources.kubernetes.client import api_client, own_namespace
from xds_server.sources.kubernetes.events import EventRecorder
from xds_server.sources.kubernetes.watch import ResourceKind, ResourceWatcher

__all__ = [
    "EventRecorder",
    "ResourceKind",
    "ResourceWatcher",
    "api_client",
    "own_namespace",
]
