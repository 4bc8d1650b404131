"""From inputs to snapshots: fold bursts of changes, build, check, store.

The slow loop of the design: inputs (today the routing config; later pods and their metrics)
mark the state dirty; after a quiet period (`updates.debounce_s`, at most `updates.max_delay_s`
after the first change) one snapshot is built from the latest inputs and handed to the cache.
A config that fails validation, or a snapshot that fails its consistency check, is logged
and counted, and the last good snapshot stays in force.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from xds_server import envoy
from xds_server.config import RoutingConfig
from xds_server.errors import ConfigError, XdsServerError
from xds_server.telemetry import Telemetry
from xds_server.xds.cache import DEFAULT_GROUP, SnapshotCache
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

__all__ = ["Controller", "SnapshotBuilder"]

logger = logging.getLogger(__name__)


def _routing_part(config: RoutingConfig) -> RoutingConfig:
    """`config` without endpoints: what clusters, listeners and routes depend on."""
    return config.model_copy(
        update={"pools": tuple(p.model_copy(update={"endpoints": ()}) for p in config.pools)}
    )


@dataclass(frozen=True)
class _Built:
    routing: RoutingConfig
    snapshot: Snapshot


class SnapshotBuilder:
    """Builds snapshots from routing configs; an endpoints-only change rebuilds only EDS.

    Mutable state: the last config's routing part and the snapshot built from it.
    """

    def __init__(self) -> None:
        self._last: _Built | None = None

    def build(self, config: RoutingConfig) -> Snapshot:
        """A consistent snapshot for `config` (raises InconsistentSnapshotError otherwise)."""
        routing = _routing_part(config)
        if self._last is not None and self._last.routing == routing:
            snapshot = self._last.snapshot.replace(
                ResourceType.ENDPOINT, envoy.build_endpoints(config)
            )
        else:
            snapshot = Snapshot.build(
                {
                    ResourceType.CLUSTER: envoy.build_clusters(config),
                    ResourceType.ENDPOINT: envoy.build_endpoints(config),
                    ResourceType.LISTENER: envoy.build_listeners(config),
                    ResourceType.ROUTE: envoy.build_routes(config),
                }
            )
        self._last = _Built(routing=routing, snapshot=snapshot)
        return snapshot


class Controller:
    """Turns accepted configs into snapshots in the cache, debounced.

    Mutable state: the latest accepted config, the time the first unapplied change arrived,
    the last error, and the event that wakes `run`. `submit` and `reject` are synchronous;
    `run` is the only task that builds.
    """

    def __init__(
        self, *, cache: SnapshotCache, telemetry: Telemetry, group: str = DEFAULT_GROUP
    ) -> None:
        self._cache = cache
        self._telemetry = telemetry
        self._group = group
        self._builder = SnapshotBuilder()
        self._config: RoutingConfig | None = None
        self._dirty_since: float | None = None
        self._last_change = 0.0
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        self.last_error: str | None = None
        self.snapshot: Snapshot | None = None

    @property
    def config(self) -> RoutingConfig | None:
        return self._config

    @property
    def ready(self) -> bool:
        """True once a snapshot has been stored: Envoys connecting now get a full config."""
        return self.snapshot is not None

    def submit(self, config: RoutingConfig) -> None:
        """Accept a validated config; it is applied after the debounce period."""
        if config == self._config:
            return
        logger.info("Routing config accepted: %d pools.", len(config.pools))
        self._telemetry.config_reloads.labels("ok").inc()
        self._telemetry.config_last_reload_ok.set(1)
        self.last_error = None
        self._config = config
        now = time.monotonic()
        self._last_change = now
        if self._dirty_since is None:
            self._dirty_since = now
        self._settled.clear()
        self._wake.set()

    def reject(self, error: ConfigError) -> None:
        """Record a config that could not be used; the last good one stays in force."""
        logger.error("%s. Keeping the last good routing config.", error)
        self._telemetry.config_reloads.labels("error").inc()
        self._telemetry.config_last_reload_ok.set(0)
        self.last_error = str(error)

    async def settled(self) -> Snapshot | None:
        """Wait until no accepted change is pending; returns the snapshot then in force."""
        await self._settled.wait()
        return self.snapshot

    async def run(self) -> None:
        """Apply changes until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._quiet_period()
            self._apply()

    async def _quiet_period(self) -> None:
        assert self._config is not None and self._dirty_since is not None
        while True:
            updates = self._config.updates
            deadline = min(
                self._last_change + updates.debounce_s, self._dirty_since + updates.max_delay_s
            )
            delay = deadline - time.monotonic()
            if delay <= 0:
                return
            await asyncio.sleep(delay)

    def _apply(self) -> None:
        config = self._config
        assert config is not None
        self._dirty_since = None
        self._settled.set()
        started = time.perf_counter()
        try:
            snapshot = self._builder.build(config)
        except (XdsServerError, ValueError) as exc:
            logger.error(
                "Could not build a snapshot from the routing config: %s. Keeping the last one.", exc
            )
            self._telemetry.config_reloads.labels("error").inc()
            self.last_error = str(exc)
            return
        self._telemetry.snapshot_build_duration.observe(time.perf_counter() - started)
        if self._cache.set_snapshot(snapshot, group=self._group):
            self._telemetry.snapshot_updates.labels(self._group).inc()
            for resource_type in ResourceType:
                self._telemetry.record_snapshot_version(
                    group=self._group,
                    type_name=resource_type.short,
                    version=snapshot.versions[resource_type],
                )
            logger.info(
                "Snapshot updated: %s.",
                ", ".join(f"{t.short} {snapshot.versions[t]}" for t in ResourceType),
            )
        self.snapshot = snapshot
