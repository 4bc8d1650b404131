"""Process-level settings (the command line, or its XDS_SERVER_* environment variables:
cli/), as opposed to the routing config (a file or a ConfigMap, config.py): where to
listen, where the config comes from, timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["KubernetesSettings", "ServerSettings", "TlsSettings", "WatchSettings"]


@dataclass(frozen=True, kw_only=True)
class WatchSettings:
    """How every Kubernetes list + watch retries (sources/kubernetes/watch.py)."""

    # Waits between attempts after a failed list or watch, one rung per failure in a row.
    backoff_s: tuple[float, ...] = (0.2, 0.5, 1, 2, 5, 10)
    # The server-side timeout of one watch request; the watch is then resumed.
    watch_timeout_s: int = 300
    # How often a resource kind the API server does not serve (a CRD not installed) is
    # looked for again.
    absent_retry_s: float = 30.0


@dataclass(frozen=True, kw_only=True)
class KubernetesSettings:
    """Where the server finds pods, Inference Extension objects and its ConfigMap."""

    # The server's own namespace: its ConfigMap and Events live here.
    namespace: str
    # Where pod selectors (without their own namespaces) and InferencePools are looked for.
    watch_namespaces: tuple[str, ...]
    # The ConfigMap holding the routing config; None reads `ServerSettings.config_path`.
    configmap: str | None = None
    # The API server: None means in-cluster, else the kubeconfig; `api_host` is for tests.
    api_host: str | None = None
    kubeconfig: Path | None = None
    watch: WatchSettings = field(default_factory=WatchSettings)


@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """Mutual TLS on the gRPC port (xds/tls.py, xds/identity.py): the server's certificate
    chain and key and the CA clients' certificates must chain to (PEM files, re-read when
    they change), and what a client's certificate must say."""

    cert: Path
    key: Path
    client_ca: Path
    # The identity an Envoy's certificate must carry; `{node_id}` is its node id. None:
    # any certificate of the client CA may speak for any node.
    envoy_identity: str | None = None
    # The identity a peer replica's certificate must carry (None: any of the client CA).
    peer_identity: str | None = None
    # The name the peers' server certificates are for (their pod IPs are not in them).
    peer_server_name: str | None = None


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Everything `xds-server run` is told on its command line (or in its variables).

    Either `config_path` or `kubernetes` with a `configmap` says where the routing config
    comes from (`config_source`); `__post_init__` refuses settings with neither.
    """

    # The routing config file; unused when the config comes from a ConfigMap.
    config_path: Path | None = None
    kubernetes: KubernetesSettings | None = None
    xds_host: str = "127.0.0.1"
    xds_port: int = 18000
    admin_host: str = "127.0.0.1"
    admin_port: int = 9000
    # The debug views (/debug/*, admin.py): on loopback unless opened on purpose. None: the
    # admin port + 1 (admin.default_debug_port), or a free port when admin_port is 0.
    debug_host: str = "127.0.0.1"
    debug_port: int | None = None
    config_poll_s: float = 1.0
    # gRPC keepalive: notice a dead Envoy (or a dead path to it) within about a minute.
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    # How often Envoys send load reports (LRS): requests in flight and rates per cluster.
    # Where a long prompt starts, the policy learns sooner from the access log (ALS).
    load_report_interval_s: float = 0.25
    # Mutual TLS on the gRPC port; None serves plaintext (the command line only does so
    # when asked to with --plaintext).
    tls: TlsSettings | None = None
    # This replica's name, as its peers know it (the pod's name on Kubernetes).
    replica: str = "xds-server"
    # The other replicas' xDS addresses ("host:port"), when they are fixed.
    peers: tuple[str, ...] = ()
    # Or the label selector of the server's own pods: its peers are the others, found
    # through the Kubernetes API in its namespace (needs `kubernetes`).
    peers_selector: str | None = None

    def __post_init__(self) -> None:
        if self.config_path is None and (
            self.kubernetes is None or self.kubernetes.configmap is None
        ):
            raise ValueError("ServerSettings needs a config_path, or Kubernetes with a ConfigMap.")
        if self.peers_selector is not None and self.kubernetes is None:
            raise ValueError("Finding peers by a label selector needs Kubernetes settings.")

    @property
    def config_source(self) -> str:
        """Where the routing config comes from, for logs."""
        k = self.kubernetes
        if k is not None and k.configmap is not None:
            return f"ConfigMap {k.namespace}/{k.configmap}"
        return str(self.config_path)
