"""Kubernetes as a source: list + watch of any kind, Events, and the client they share."""

from xds_server.sources.kubernetes.client import KubernetesError, api_client, own_namespace
from xds_server.sources.kubernetes.events import EventRecorder
from xds_server.sources.kubernetes.watch import (
    KubernetesTelemetry,
    ResourceKind,
    ResourceWatcher,
)

__all__ = [
    "EventRecorder",
    "KubernetesError",
    "KubernetesTelemetry",
    "ResourceKind",
    "ResourceWatcher",
    "api_client",
    "own_namespace",
]
