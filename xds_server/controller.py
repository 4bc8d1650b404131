"""From inputs to snapshots: fold bursts of changes, build, check, store.

The slow loop of the design: inputs (the routing config, and the pods' metrics) mark the
state dirty; shortly after (see Controller) the policy scores the pods (policy/scoring.py),
one snapshot is built from the latest inputs and handed to the cache. An unchanged desired
state builds nothing. A config that fails validation, or a snapshot that fails its
consistency check, is logged and counted, and the last good snapshot stays in force.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from xds_server import envoy
from xds_server.config import RoutingConfig
from xds_server.errors import ConfigError, XdsServerError
from xds_server.policy.scoring import PodSignals, endpoint_id, score_pool
from xds_server.policy.state import DesiredState, PoolState
from xds_server.telemetry import Telemetry
from xds_server.xds.cache import DEFAULT_GROUP, SnapshotCache
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

__all__ = ["Controller", "SignalsSource", "SnapshotBuilder"]

logger = logging.getLogger(__name__)


def _routing_part(config: RoutingConfig) -> RoutingConfig:
    """`config` without endpoints: what clusters, listeners and routes depend on."""
    return config.model_copy(
        update={"pools": tuple(p.model_copy(update={"endpoints": ()}) for p in config.pools)}
    )


@dataclass(frozen=True)
class _Built:
    routing: RoutingConfig
    # What EDS was built from (the whole config: endpoints, and pools' routing), and RTDS.
    config: RoutingConfig
    pools: Mapping[str, PoolState]
    runtime: Mapping[str, float]
    snapshot: Snapshot


class SnapshotBuilder:
    """Builds snapshots from routing configs; only the types whose inputs changed are rebuilt.

    A routing change rebuilds everything; an endpoints-only change rebuilds only EDS, and a
    runtime-only change (`DesiredState.runtime`) only RTDS, so Envoy is sent only those.

    Mutable state: the inputs of the last build and the snapshot built from them.
    """

    def __init__(self) -> None:
        self._last: _Built | None = None

    def build(self, config: RoutingConfig, state: DesiredState | None = None) -> Snapshot:
        """A consistent snapshot for `config` and the policy's `state` of its endpoints.

        Raises InconsistentSnapshotError (or ValueError) for resources that cannot be served.
        """
        state = state if state is not None else DesiredState()
        routing = _routing_part(config)
        last = self._last
        if last is not None and last.routing == routing:
            snapshot = last.snapshot
            if last.config != config or last.pools != state.pools:
                snapshot = snapshot.replace(
                    ResourceType.ENDPOINT, envoy.build_endpoints(config, state)
                )
            if last.runtime != state.runtime:
                snapshot = snapshot.replace(
                    ResourceType.RUNTIME, envoy.build_runtime(state.runtime)
                )
        else:
            snapshot = Snapshot.build(
                {
                    ResourceType.RUNTIME: envoy.build_runtime(state.runtime),
                    ResourceType.CLUSTER: envoy.build_clusters(config),
                    ResourceType.ENDPOINT: envoy.build_endpoints(config, state),
                    ResourceType.LISTENER: envoy.build_listeners(config),
                    ResourceType.ROUTE: envoy.build_routes(config),
                }
            )
        self._last = _Built(
            routing=routing,
            config=config,
            pools=state.pools,
            runtime=state.runtime,
            snapshot=snapshot,
        )
        return snapshot


class SignalsSource(Protocol):
    """The latest metrics of every scraped pod, by endpoint id ("address:port")."""

    def __call__(self) -> Mapping[str, PodSignals]: ...


class Controller:
    """Turns accepted configs and pod metrics into snapshots in the cache.

    A config change is debounced (`updates.debounce_s` after the last change, at most
    `updates.max_delay_s` after the first); metrics changes are throttled (applied
    `debounce_s` after the first one, however many follow) so that a steady stream of
    scrapes still reaches Envoy promptly. With GPU-aware pools the state is also re-scored
    every scrape interval, so a pod whose metrics stop arriving goes stale on time.

    Mutable state: the latest accepted config, the pending deadline, the policy's memory
    (smoothed scores per pool), the last desired state, the last error and the events that
    wake `run`. `submit`, `reject` and `metrics_changed` are synchronous; `run` is the only
    task that builds.
    """

    def __init__(
        self,
        *,
        cache: SnapshotCache,
        telemetry: Telemetry,
        signals: SignalsSource | None = None,
        group: str = DEFAULT_GROUP,
    ) -> None:
        self._cache = cache
        self._telemetry = telemetry
        self._signals = signals
        self._group = group
        self._builder = SnapshotBuilder()
        self._config: RoutingConfig | None = None
        self._dirty_since: float | None = None
        self._deadline = 0.0
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        self._memory: dict[str, Mapping[str, float]] = {}
        self._built: tuple[RoutingConfig, DesiredState] | None = None
        self.last_error: str | None = None
        self.snapshot: Snapshot | None = None
        self.state = DesiredState()

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
        self._schedule(extend=True)

    def metrics_changed(self) -> None:
        """New pod metrics arrived; re-score within `debounce_s` (not extended by more)."""
        if self._config is not None:
            self._schedule(extend=False)

    def reject(self, error: ConfigError) -> None:
        """Record a config that could not be used; the last good one stays in force."""
        logger.error("%s. Keeping the last good routing config.", error)
        self._telemetry.config_reloads.labels("error").inc()
        self._telemetry.config_last_reload_ok.set(0)
        self.last_error = str(error)

    def _schedule(self, *, extend: bool) -> None:
        assert self._config is not None
        updates = self._config.updates
        now = time.monotonic()
        if self._dirty_since is None:
            self._dirty_since = now
            self._deadline = now + updates.debounce_s
        elif extend:
            self._deadline = min(now + updates.debounce_s, self._dirty_since + updates.max_delay_s)
        self._settled.clear()
        self._wake.set()

    async def settled(self) -> Snapshot | None:
        """Wait until no accepted change is pending; returns the snapshot then in force."""
        await self._settled.wait()
        return self.snapshot

    def _rescore_interval(self) -> float | None:
        config = self._config
        if (
            config is None
            or self._signals is None
            or not any(p.weights_from_metrics for p in config.pools)
        ):
            return None
        return config.balancing.scrape_interval_s

    async def run(self) -> None:
        """Apply changes until cancelled."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._rescore_interval())
            except TimeoutError:
                self.metrics_changed()
            self._wake.clear()
            # The deadline may move while we sleep (a debounced config change extends it).
            while (delay := self._deadline - time.monotonic()) > 0:  # noqa: ASYNC110
                await asyncio.sleep(delay)
            self._apply()

    def _desired_state(self, config: RoutingConfig) -> DesiredState:
        if self._signals is None:
            return DesiredState()
        signals = self._signals()
        pools = {}
        for pool in config.pools:
            if not pool.weights_from_metrics:
                continue
            scored = score_pool(
                pool,
                settings=config.balancing,
                signals=signals,
                memory=self._memory.get(pool.name, {}),
                draining={endpoint_id(e) for e in pool.endpoints if e.draining},
            )
            self._memory[pool.name] = scored.memory
            pools[pool.name] = scored.state
        return DesiredState(pools=pools)

    def _apply(self) -> None:
        config = self._config
        assert config is not None
        self._dirty_since = None
        self._settled.set()
        state = self._desired_state(config)
        self.state = state
        if self._built is not None and self._built == (config, state):
            return
        started = time.perf_counter()
        try:
            snapshot = self._builder.build(config, state)
        except (XdsServerError, ValueError) as exc:
            logger.error(
                "Could not build a snapshot from the routing config: %s. Keeping the last one.", exc
            )
            self._telemetry.config_reloads.labels("error").inc()
            self.last_error = str(exc)
            return
        self._built = (config, state)
        self._telemetry.snapshot_build_duration.observe(time.perf_counter() - started)
        if self._cache.set_snapshot(snapshot, group=self._group):
            self._telemetry.snapshot_updates.labels(self._group).inc()
            for resource_type in ResourceType:
                self._telemetry.record_snapshot_version(
                    group=self._group,
                    type_name=resource_type.short,
                    version=snapshot.versions[resource_type],
                )
            logger.debug(
                "Snapshot updated: %s.",
                ", ".join(f"{t.short} {snapshot.versions[t]}" for t in ResourceType),
            )
        self.snapshot = snapshot
