"""Where the routing config comes from: a ConfigMap (on Kubernetes) or a file.

Each yields every document as it changes, parsed and validated (`RoutingConfig`), or the
`ConfigError` that says why it cannot be used; the caller keeps the last good one. Both
parse in a child process, bounded in size, aliases and time (`config_document`), refuse a
config that takes away the last of a pool's listed endpoints (unless the pool says
`allow_empty`), and warn (log, `xds_config_warnings_total`, an Event on a ConfigMap) about
any other config that leaves a pool without endpoints.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from xds_server.config import RoutingConfig
from xds_server.errors import ConfigError
from xds_server.settings import ServerSettings
from xds_server.sources.config_file import watch_config_file
from xds_server.sources.kubernetes.configmap import watch_configmap
from xds_server.sources.kubernetes.events import EventRecorder
from xds_server.telemetry import Telemetry
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

__all__ = ["routing_config_documents"]


def routing_config_documents(
    settings: ServerSettings,
    *,
    kubernetes_api: Any = None,
    telemetry: KubernetesTelemetry | None = None,
    server_telemetry: Telemetry | None = None,
) -> AsyncIterator[RoutingConfig | ConfigError]:
    """The documents of `settings.config_source`, as they change. A ConfigMap source needs
    the `kubernetes_api` client (and records an Event for each config it refuses, or accepts
    with a warning). `server_telemetry` counts the warnings."""
    k = settings.kubernetes
    if k is not None and k.configmap is not None:
        if kubernetes_api is None:
            raise ValueError("A ConfigMap source needs a Kubernetes API client.")
        return watch_configmap(
            kubernetes_api,
            namespace=k.namespace,
            name=k.configmap,
            events=EventRecorder(kubernetes_api, telemetry=telemetry),
            telemetry=telemetry,
            watch=k.watch,
            server_telemetry=server_telemetry,
        )
    assert settings.config_path is not None  # ServerSettings refuses settings without either
    return watch_config_file(
        settings.config_path,
        interval_s=settings.config_poll_s,
        # On Kubernetes, discovery finds the pods of the pools' selectors.
        selectors_followed=k is not None,
        telemetry=server_telemetry,
    )
