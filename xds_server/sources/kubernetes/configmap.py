"""The routing config from a ConfigMap, followed through the API (list + watch of one object).

Watching the object rather than reading a mounted file applies a change within a second of
the update instead of after the kubelet's sync period (a minute or more), and lets the
server answer on the object itself: an invalid document gets a Warning Event on the
ConfigMap (`kubectl describe configmap` shows it beside the change that caused it), while
the last good config stays in force, and so does one that takes away the last of a pool's
listed endpoints (`config_document.refuse_emptied_pools`); a valid one gets a Normal
Event, and a Warning Event too when it leaves a pool without endpoints
(`config_document.warn_empty_pools`).

The document is parsed in a child process (`config_document.parse_in_child`), bounded in
size, aliases and time, so that no document can stall the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kubernetes

from xds_server.config import ParseLimits, RoutingConfig
from xds_server.errors import ConfigError
from xds_server.settings import WatchSettings
from xds_server.sources.config_document import (
    PARSE_TIMEOUT_S,
    parse_in_child,
    refuse_emptied_pools,
    warn_empty_pools,
)
from xds_server.sources.kubernetes.events import EventRecorder
from xds_server.sources.kubernetes.watch import ResourceKind, ResourceWatcher, watch_options
from xds_server.telemetry import Telemetry
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

__all__ = ["CONFIG_KEY", "watch_configmap"]

logger = logging.getLogger(__name__)

# The ConfigMap key holding the routing document.
CONFIG_KEY = "config.yaml"

_LIMITS = ParseLimits()


async def _read(
    configmap: Mapping[str, Any] | None, *, source: str, limits: ParseLimits, timeout_s: float
) -> RoutingConfig:
    if configmap is None:
        raise ConfigError(f"{source}: not found")
    document = (configmap.get("data") or {}).get(CONFIG_KEY)
    if document is None:
        raise ConfigError(f"{source}: has no key {CONFIG_KEY!r}")
    if not isinstance(document, str):
        raise ConfigError(f"{source}: key {CONFIG_KEY!r} is not a string")
    return await parse_in_child(document, source=source, limits=limits, timeout_s=timeout_s)


async def watch_configmap(
    api_client: kubernetes.client.ApiClient,
    *,
    namespace: str,
    name: str,
    events: EventRecorder,
    telemetry: KubernetesTelemetry | None = None,
    watch: WatchSettings | None = None,
    limits: ParseLimits = _LIMITS,
    parse_timeout_s: float = PARSE_TIMEOUT_S,
    server_telemetry: Telemetry | None = None,
) -> AsyncIterator[RoutingConfig | ConfigError]:
    """Yield the parsed config once the ConfigMap is listed and after every change of its
    content; errors are yielded (and recorded as Events), not raised. A config that takes
    away the last of a pool's listed endpoints, compared with the one yielded last, is such
    an error (`refuse_emptied_pools`). A config that leaves a pool without endpoints is
    yielded after a Warning Event (counted in `server_telemetry`)."""
    source = f"ConfigMap {namespace}/{name}"
    changed = asyncio.Event()
    watcher = ResourceWatcher(
        api_client,
        ResourceKind(
            group="",
            version="v1",
            plural="configmaps",
            namespace=namespace,
            field_selector=f"metadata.name={name}",
        ),
        on_change=changed.set,
        telemetry=telemetry,
        **watch_options(watch or WatchSettings()),
    )
    task = asyncio.create_task(watcher.run(), name="watch-configmap")
    last_digest: bytes | None = None
    # The config yielded last: what a new one may not empty pools of.
    accepted: RoutingConfig | None = None
    try:
        while True:
            await changed.wait()
            changed.clear()
            if not watcher.synced:
                continue
            configmap = watcher.objects.get(f"{namespace}/{name}")
            data = None if configmap is None else configmap.get("data")
            digest = hashlib.sha256(repr(data).encode()).digest()
            if digest == last_digest:
                continue
            last_digest = digest
            try:
                config = await _read(
                    configmap, source=source, limits=limits, timeout_s=parse_timeout_s
                )
                refuse_emptied_pools(accepted, config, source=source, selectors_followed=True)
            except ConfigError as exc:
                if configmap is not None:
                    await events.record(
                        involved=configmap, reason="InvalidConfig", message=str(exc)
                    )
                yield exc
            else:
                assert configmap is not None
                await events.record(
                    involved=configmap,
                    reason="ConfigApplied",
                    message="Routing config is valid; applying it.",
                    type="Normal",
                )
                warning = warn_empty_pools(
                    config, source=source, selectors_followed=True, telemetry=server_telemetry
                )
                if warning is not None:
                    await events.record(
                        involved=configmap,
                        reason="PoolWithoutEndpoints",
                        message=warning,
                    )
                accepted = config
                yield config
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
