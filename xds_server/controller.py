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
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

from xds_server import envoy
from xds_server.config import BANDS, Band, PoolConfig, RoutingConfig
from xds_server.envoy import names
from xds_server.errors import ConfigError, XdsServerError
from xds_server.policy.admission import BandLoad, PodCapacity, admit
from xds_server.policy.scoring import PodSignals, endpoint_id, score_pool
from xds_server.policy.state import DesiredState, Health, PoolState
from xds_server.telemetry import Telemetry
from xds_server.xds.cache import DEFAULT_GROUP, SnapshotCache
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

__all__ = [
    "Controller",
    "LoadSource",
    "SignalsSource",
    "SnapshotBuilder",
    "band_clusters",
    "long_prompt_clusters",
]

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
    retry_after: Mapping[tuple[str, Band], int]
    snapshot: Snapshot


class SnapshotBuilder:
    """Builds snapshots from routing configs; only the types whose inputs changed are rebuilt.

    A routing change rebuilds everything; an endpoints-only change rebuilds only EDS, and a
    runtime-only change (`DesiredState.runtime`) only RTDS, and a Retry-After change
    (`DesiredState.retry_after`, route metadata) only RDS, so Envoy is sent only those.

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
            if last.retry_after != state.retry_after:
                snapshot = snapshot.replace(
                    ResourceType.ROUTE, envoy.build_routes(config, state.retry_after)
                )
        else:
            snapshot = Snapshot.build(
                {
                    ResourceType.RUNTIME: envoy.build_runtime(state.runtime),
                    ResourceType.CLUSTER: envoy.build_clusters(config),
                    ResourceType.ENDPOINT: envoy.build_endpoints(config, state),
                    ResourceType.LISTENER: envoy.build_listeners(config),
                    ResourceType.ROUTE: envoy.build_routes(config, state.retry_after),
                }
            )
        self._last = _Built(
            routing=routing,
            config=config,
            pools=state.pools,
            runtime=state.runtime,
            retry_after=state.retry_after,
            snapshot=snapshot,
        )
        return snapshot


class SignalsSource(Protocol):
    """The latest metrics of every scraped pod, by endpoint id ("address:port")."""

    def __call__(self) -> Mapping[str, PodSignals]: ...


class LoadSource(Protocol):
    """What the Envoys report of the load they carry (LRS, and their access log of long
    prompts): for flow control, and the pods busy with long prompts."""

    def band_load(self, clusters: Mapping[Band, Sequence[str]]) -> BandLoad:
        """In-flight requests per band (summed over the band's `clusters` and every Envoy)
        and the completions per second of all of them together."""
        ...

    def envoys(self) -> int:
        """How many Envoys share the limits (at least 1)."""
        ...

    def long_prompts_by_endpoint(self, clusters: Sequence[str]) -> Mapping[str, int]:
        """Long prompts that may still hold their pod's GPU per endpoint id
        ("address:port"), on `clusters` (which carry only long prompts), summed over them
        and every Envoy; endpoints with none may be left out."""
        ...


def band_clusters(config: RoutingConfig, pool: PoolConfig) -> dict[Band, list[str]]:
    """The clusters that admit each band of `pool`, one per lane (names.band_cluster_name)."""
    lanes = config.lanes(pool)
    return {
        band: [names.band_cluster_name(pool.name, band, lane) for lane in lanes] for band in BANDS
    }


def long_prompt_clusters(config: RoutingConfig, pool: PoolConfig) -> list[str]:
    """The clusters that carry `pool`'s long prompts (none without a long-prompt lane)."""
    if "long" not in config.lanes(pool):
        return []
    if config.flow_control.enabled:
        return [names.band_cluster_name(pool.name, band, "long") for band in BANDS]
    return [names.lane_cluster_name(pool.name, "long")]


def _capacity_inputs(
    pool: PoolConfig, state: PoolState | None, signals: Mapping[str, PodSignals]
) -> list[PodCapacity]:
    """The pool's ready pods as admission sees them: healthy, not draining, with their load
    when their metrics are scraped (a pool without metrics counts every pod as idle)."""
    if state is not None:
        ready = {e.id: e.hardware for e in state.endpoints if e.health is Health.HEALTHY}
    else:
        ready = {endpoint_id(e): e.hardware for e in pool.endpoints if not e.draining}
    pods = []
    for key, hardware in sorted(ready.items()):
        observed = signals.get(key)
        pods.append(
            PodCapacity(
                hardware=hardware,
                running=observed.running if observed is not None else 0.0,
                waiting=observed.waiting if observed is not None else 0.0,
                kv_usage=observed.kv_usage if observed is not None else None,
            )
        )
    return pods


class Controller:
    """Turns accepted configs and pod metrics into snapshots in the cache.

    A config change is debounced (`updates.debounce_s` after the last change, at most
    `updates.max_delay_s` after the first); metrics changes are throttled (applied
    `debounce_s` after the first one, however many follow) so that a steady stream of
    scrapes still reaches Envoy promptly; a long prompt starting or ending on a pod (access
    log, load reports) is applied at once. With GPU-aware pools the state is also re-scored
    every scrape interval, so a pod whose metrics stop arriving goes stale on time.

    Mutable state: the latest accepted config, the pending deadline, the policy's memory
    (smoothed scores, adapter placement and activity per pool), the last desired state,
    the last error and the events that wake `run`. `submit`, `reject` and
    `metrics_changed` are synchronous; `run` is the only task that builds.
    """

    def __init__(
        self,
        *,
        cache: SnapshotCache,
        telemetry: Telemetry,
        signals: SignalsSource | None = None,
        load: LoadSource | None = None,
        group: str = DEFAULT_GROUP,
    ) -> None:
        self._cache = cache
        self._telemetry = telemetry
        self._signals = signals
        self._load = load
        self._group = group
        self._builder = SnapshotBuilder()
        self._config: RoutingConfig | None = None
        self._dirty_since: float | None = None
        self._deadline = 0.0
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        self._memory: dict[str, Mapping[str, float]] = {}
        self._placement: dict[str, Mapping[str, tuple[str, ...]]] = {}
        self._adapter_activity: dict[str, Mapping[str, float]] = {}
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

    def load_changed(self, clusters: Set[str]) -> None:
        """The Envoys' access log or load reports changed the requests in flight per endpoint
        of `clusters`. When they carry long prompts, re-score now, without debounce: a pod
        that just took a long prefill should get no more short requests, and each fraction
        of a second sends it more."""
        config = self._config
        if config is None:
            return
        if any(c in clusters for p in config.pools for c in long_prompt_clusters(config, p)):
            self._schedule(extend=False, now=True)

    def reject(self, error: ConfigError) -> None:
        """Record a config that could not be used; the last good one stays in force."""
        logger.error("%s. Keeping the last good routing config.", error)
        self._telemetry.config_reloads.labels("error").inc()
        self._telemetry.config_last_reload_ok.set(0)
        self.last_error = str(error)

    def _schedule(self, *, extend: bool, now: bool = False) -> None:
        assert self._config is not None
        updates = self._config.updates
        at = time.monotonic()
        if now:
            self._dirty_since = self._dirty_since if self._dirty_since is not None else at
            self._deadline = at
        elif self._dirty_since is None:
            self._dirty_since = at
            self._deadline = at + updates.debounce_s
        elif extend:
            self._deadline = min(at + updates.debounce_s, self._dirty_since + updates.max_delay_s)
        self._settled.clear()
        self._wake.set()

    async def settled(self) -> Snapshot | None:
        """Wait until no accepted change is pending; returns the snapshot then in force."""
        await self._settled.wait()
        return self.snapshot

    def _rescore_interval(self) -> float | None:
        config = self._config
        if config is None:
            return None
        scored = self._signals is not None and any(p.weights_from_metrics for p in config.pools)
        admitted = self._load is not None and config.flow_control.enabled
        return config.balancing.scrape_interval_s if scored or admitted else None

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
        signals = self._signals() if self._signals is not None else {}
        pools = {}
        for pool in config.pools:
            if not pool.weights_from_metrics or self._signals is None:
                continue
            long_prompts = long_prompt_clusters(config, pool)
            scored = score_pool(
                pool,
                settings=config.balancing,
                signals=signals,
                long_prompts=self._load.long_prompts_by_endpoint(long_prompts)
                if self._load is not None and long_prompts
                else {},
                memory=self._memory.get(pool.name, {}),
                placement=self._placement.get(pool.name, {}),
                adapter_activity=self._adapter_activity.get(pool.name, {}),
                draining={endpoint_id(e) for e in pool.endpoints if e.draining},
            )
            self._memory[pool.name] = scored.memory
            self._placement[pool.name] = scored.placement
            self._adapter_activity[pool.name] = scored.adapter_activity
            pools[pool.name] = scored.state
        if not config.flow_control.enabled or self._load is None:
            return DesiredState(pools=pools)
        runtime: dict[str, float] = {}
        retry_after: dict[tuple[str, Band], int] = {}
        admissions = {}
        for pool in config.pools:
            clusters = band_clusters(config, pool)
            admission = admit(
                _capacity_inputs(pool, pools.get(pool.name), signals),
                load=self._load.band_load(clusters),
                envoys=self._load.envoys(),
                settings=config.flow_control,
                # Limits stand about one interval, and reach Envoy within another.
                horizon_s=2 * config.balancing.scrape_interval_s,
            )
            admissions[pool.name] = admission
            for band in BANDS:
                retry_after[(pool.name, band)] = admission.retry_after_s[band]
                for cluster in clusters[band]:
                    key = f"circuit_breakers.{cluster}.default.max_requests"
                    runtime[key] = admission.max_requests[band]
        return DesiredState(
            pools=pools, runtime=runtime, retry_after=retry_after, admissions=admissions
        )

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
