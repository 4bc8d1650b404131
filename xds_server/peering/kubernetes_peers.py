"""The server's peers on Kubernetes: the other Ready replicas of its own Deployment.

Replicas find each other through the API rather than DNS or a Service: the Service
`xds-server` is a ClusterIP (one virtual address, balanced, so it cannot name each
replica), and the Role already lets the server list and watch pods in its own namespace
(k8s/server/rbac.yaml), so a pod watch with the Deployment's label selector
(`--peers-selector`) needs no new permission and sees a replica come or go within a
second. It is one more `ResourceWatcher`, which does all the retrying.

A pod is a peer when another replica could answer on it now:

- it has a pod IP and its phase is Running;
- its Ready condition is True: the replica has a snapshot (`/readyz`), so it has Envoys'
  load worth sharing, and the kubelet folds every readiness gate into that condition;
- it is not being deleted: a stopping replica stays Ready through its preStop wait, but
  its Envoys are already moving to the others, so a link to it would only be cut soon;
- it is not this server's own pod (`own_pod`, from the downward API's POD_NAME).

Peers are "podIP:port" (the xDS port, where replicas also serve each other), with IPv6
addresses in brackets as gRPC targets need them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import kubernetes.client

from xds_server.settings import WatchSettings
from xds_server.sources.kubernetes.watch import ResourceKind, ResourceWatcher, watch_options
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

__all__ = ["KubernetesPeers"]

logger = logging.getLogger(__name__)


class KubernetesPeers:
    """The server's peers on Kubernetes: the Ready pods of its own Deployment (pods in
    `namespace` matching `selector`), other than itself, as "podIP:port" addresses.

    `on_peers(peers)` gets the full set once after the first list (even when empty: the
    caller then knows there is no one else yet) and again whenever it changes, never the set
    it last accepted. If it raises, the watch logs it and goes on, and the same set is
    offered again at the next pod event. `own_pod` None (outside a pod) counts every
    matching pod. The watch reports to `telemetry` as resource "pods", beside discovery's.

    Mutable state: `_peers`, the set `on_peers` last accepted (None: none yet). Changed
    only on the event loop, by the watcher's callback.
    """

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        *,
        namespace: str,
        selector: str,
        port: int,
        own_pod: str | None,
        on_peers: Callable[[frozenset[str]], None],
        telemetry: KubernetesTelemetry,
        watch: WatchSettings,
    ) -> None:
        # An empty namespace or selector would make every pod of the namespace (or of the
        # cluster) a peer: Envoys and model servers included.
        if not namespace or not selector.strip():
            raise ValueError("Peers on Kubernetes need a namespace and a label selector.")
        self.port = port
        self.own_pod = own_pod
        self._on_peers = on_peers
        self._peers: frozenset[str] | None = None
        self._watcher = ResourceWatcher(
            api,
            ResourceKind(
                group="", version="v1", plural="pods", namespace=namespace, label_selector=selector
            ),
            on_change=self._changed,
            telemetry=telemetry,
            **watch_options(watch),
        )

    def __repr__(self) -> str:
        return f"<KubernetesPeers {self._watcher.kind} peers={self._peers}>"

    async def run(self) -> None:
        """Watch the pods until cancelled (the watcher retries every failure itself)."""
        await self._watcher.run()

    def _changed(self) -> None:
        peers = frozenset(
            _address(pod["status"]["podIP"], self.port)
            for pod in self._watcher.objects.values()
            if _is_peer(pod, own_pod=self.own_pod)
        )
        if peers == self._peers:
            return
        logger.info("Peers from %s: %s.", self._watcher.kind, ", ".join(sorted(peers)) or "none")
        self._on_peers(peers)
        self._peers = peers


def _is_peer(pod: Mapping[str, Any], *, own_pod: str | None) -> bool:
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    return (
        ready
        and bool(status.get("podIP"))
        and status.get("phase") == "Running"
        and metadata.get("deletionTimestamp") is None
        and metadata.get("name") != own_pod
    )


def _address(ip: str, port: int) -> str:
    """`ip:port`, or `[ip]:port` for an IPv6 address (the form gRPC targets take)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
