"""The slow loop's scheduler: fold bursts of changes, decide, build, store.

Inputs (the routing config, the pods' metrics, the Envoys' load) mark the state dirty;
shortly after (see Controller) the policy decides (`policy.decide`, pure) and the snapshot
builder (snapshot_builder.py) turns the decision into a snapshot for the cache. An unchanged
decision builds nothing. A config that fails validation, or a snapshot that cannot be
built, is logged and counted, and the last good snapshot stays in force.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Set
from types import MappingProxyType
from typing import Protocol, TypeVar

from xds_server.clock import Clock, loop_clock
from xds_server.config import RoutingConfig
from xds_server.envoy import names
from xds_server.errors import ConfigError, XdsServerError
from xds_server.policy.buckets import FollowedBuckets
from xds_server.policy.decision import (
    Decider,
    Decision,
    DecisionInputs,
    FleetLoad,
    PolicyMemory,
)
from xds_server.policy.failover import FailoverMemory, PoolFailover, RemoteView, plan_pool
from xds_server.policy.signals import PodSignals, endpoint_id
from xds_server.snapshot_builder import SnapshotBuilder
from xds_server.steps import Steps
from xds_server.telemetry import Telemetry
from xds_server.xds.cache import DEFAULT_GROUP, SnapshotCache
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

__all__ = [
    "Controller",
    "HomeBuckets",
    "LOAD_DECISION_GAP_S",
    "LoadSource",
    "RemotesSource",
    "SLICE_S",
    "SessionKeysSource",
    "SignalsSource",
]

# Decisions due to load changes (a long prompt starting or ending) or to Envoys connecting
# come at most this often: a rollout of 500 Envoys is a few dozen decisions, not 500.
LOAD_DECISION_GAP_S = 0.05
# The longest the controller holds the event loop in one go while deciding or building
# (the rest of the work waits for the loop's next pass).
SLICE_S = 0.01
# Of an Envoy's error, what `spill_fallback` keeps (the whole is in the NACK's log line).
_MAX_REASON_CHARS = 500

logger = logging.getLogger(__name__)

T = TypeVar("T")


# No session keys logged: the same object every time, so that a decision on it is skipped.
_NO_SESSION_KEYS: Mapping[str, Mapping[int, float]] = MappingProxyType({})
_NO_HOMES: Mapping[str, Mapping[str, float]] = MappingProxyType({})
_NO_SERVED_BY: Mapping[str, Mapping[int, str]] = MappingProxyType({})
_NO_RETURNS: Mapping[str, Mapping[str, float]] = MappingProxyType({})
_NO_BUCKETS: Mapping[str, FollowedBuckets] = MappingProxyType({})
_NO_FIRSTS: Mapping[str, Mapping[str, int]] = MappingProxyType({})
# Per pool that keeps key buckets: each endpoint's pinned buckets, and the endpoints new
# keys go to (Controller.home_buckets; peering/reports.py's SessionKeysReport).
HomeBuckets = tuple[dict[str, dict[str, tuple[int, ...]]], dict[str, tuple[str, ...]]]


class SessionKeysSource(Protocol):
    """Per pool, the hashes of the session keys its Envoys logged and their recent requests
    (xds/session_keys.py). The same object as the last call's while no key was logged."""

    def __call__(self) -> Mapping[str, Mapping[int, float]]: ...


class ServedBySource(Protocol):
    """Per pool, the pod (endpoint id) each key its own Envoys logged was last served by
    (xds/session_keys.py). The same object while unchanged."""

    def __call__(self) -> Mapping[str, Mapping[int, str]]: ...


class KeyReturnsSource(Protocol):
    """Per pool, per pod (endpoint id), the share of the keyed requests it was sent that
    returned to it, their key last served by it (xds/session_keys.py). The same object
    while unchanged."""

    def __call__(self) -> Mapping[str, Mapping[str, float]]: ...


class FirstRequestsSource(Protocol):
    """Per pool, per pod (endpoint id), the keys whose first request on it its own Envoys
    logged in the last `within_s` seconds (xds/session_keys.py). The same object while
    unchanged."""

    def __call__(self, within_s: float) -> Mapping[str, Mapping[str, int]]: ...


class FollowedBucketsSource(Protocol):
    """Per pool that keeps key buckets, the table of the replica this one follows
    (peering/links.py); empty when it keeps its own. The same object while unchanged."""

    def __call__(self) -> Mapping[str, FollowedBuckets]: ...


class FollowedHomesSource(Protocol):
    """Per session pool, the ring-weight factors of the replica this one follows
    (peering/links.py); empty when it places its own. The same object while unchanged."""

    def __call__(self) -> Mapping[str, Mapping[str, float]]: ...


class SignalsSource(Protocol):
    """The latest metrics of every scraped pod, by endpoint id ("address:port"), with their
    ages at `now` (the controller's clock). The same object as the last call's while no
    signal changed: the controller skips a decision whose inputs are the last one's."""

    def __call__(self, now: float) -> Mapping[str, PodSignals]: ...


class LoadSource(Protocol):
    """What the fleet's Envoys report of the load they carry (LRS, and their access log of
    long prompts; this replica's and its peers'), translated from Envoy's cluster names to
    `config`'s pools and bands."""

    def fleet_load(self, config: RoutingConfig) -> FleetLoad: ...


class RemotesSource(Protocol):
    """What the server knows of each pool's remotes (other clusters' gateways): pool name
    -> remote name -> view (addresses resolved, the remote server's summary)."""

    def views(self, config: RoutingConfig) -> Mapping[str, Mapping[str, RemoteView]]: ...


class Controller:
    """Turns accepted configs, pod metrics and Envoy load into snapshots in the cache.

    A config change is debounced (`updates.debounce_s` after the last change, at most
    `updates.max_delay_s` after the first); metrics changes are throttled (applied
    `debounce_s` after the first one, however many follow) so that a steady stream of
    scrapes still reaches Envoy promptly, and so is a key new to its pod in the session-key
    log (pools with key buckets); a long prompt starting or ending on a pod (access
    log, load reports) is applied at once. With GPU-aware pools or flow control, the
    policy also looks every scrape interval, so a pod whose metrics stop arriving goes
    stale on time.

    Work is paid only for change: a decision whose inputs are the last one's objects (the
    sources hand out the same objects while nothing changed) and whose memory came back
    unchanged would give the same decision, so it is skipped; each pool is decided again
    only when its own inputs changed (policy.Decider); a decision equal to the last builds
    nothing; a build rebuilds only what changed (snapshot_builder.py). An idle fleet of any
    size costs a few dictionary lookups per interval.

    Mutable state: the latest accepted config, the pending deadline, the policy's memory,
    the last decision with what it was decided on and how long it took, the last error
    (and whether a config was refused since the last accepted one), when the first config
    came (the warm start) and the events that wake `run`. `submit`, `reject`,
    `metrics_changed`, `keys_changed` and `load_changed` are synchronous; `run` is the only
    task that decides and builds, in slices (`SLICE_S`); a change that comes meanwhile is
    decided next. Time is read from `clock` only (the slices' length from a wall clock: it is
    how long the loop is held, not logic).
    """

    def __init__(
        self,
        *,
        cache: SnapshotCache,
        telemetry: Telemetry,
        signals: SignalsSource | None = None,
        load: LoadSource | None = None,
        remotes: RemotesSource | None = None,
        session_keys: SessionKeysSource | None = None,
        followed_homes: FollowedHomesSource | None = None,
        served_by: ServedBySource | None = None,
        key_returns: KeyReturnsSource | None = None,
        first_requests: FirstRequestsSource | None = None,
        followed_buckets: FollowedBucketsSource | None = None,
        group: str = DEFAULT_GROUP,
        clock: Clock = loop_clock,
    ) -> None:
        self._cache = cache
        self._telemetry = telemetry
        self._signals = signals
        self._load = load
        self._session_keys = session_keys
        self._followed_homes = followed_homes
        self._served_by = served_by
        self._key_returns = key_returns
        self._first_requests = first_requests
        self._followed_buckets = followed_buckets
        self._remotes = remotes
        self._group = group
        self._clock = clock
        self._builder = SnapshotBuilder()
        self._config: RoutingConfig | None = None
        self._dirty_since: float | None = None
        self._deadline = 0.0
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        self._memory = PolicyMemory()
        self._decider = Decider()
        # The config, signals, load and session keys of the last decision, and whether the
        # memory it returned was the one it was given (then the same inputs decide the same).
        self._decided_on: tuple[object, ...] | None = None
        # How long the last decision and build took (wall time, slices included).
        self._last_decision_s = 0.0
        self._memory_settled = False
        self._built: tuple[RoutingConfig, Decision] | None = None
        self.last_error: str | None = None
        # A config was refused since the last one accepted (`last_error` is its error).
        self._refused = False
        # When the first config came: the first snapshot waits a little for the pods'
        # first scrapes from then on (`_warming`).
        self._first_config_at: float | None = None
        # When the last decision due to load (a long prompt) was scheduled.
        self._last_load_decision = float("-inf")
        # Why spilled keys go to the ring although the config says "pool": an Envoy
        # refused a spill listener (`envoy_rejected`); None while they go to the pool.
        self.spill_fallback: str | None = None
        # The config accepted last and its copy with `spill_to` "ring" (`_in_force`).
        self._ring_config: tuple[RoutingConfig, RoutingConfig] | None = None
        self.snapshot: Snapshot | None = None
        self.decision = Decision()
        # (pool, node id) of the Envoys whose reports the last decision did not believe.
        self._clipped: set[tuple[str, str]] = set()
        # Per pool with remotes, what its failover remembers (policy/failover.py).
        self.failover_memory: dict[str, FailoverMemory] = {}

    @property
    def config(self) -> RoutingConfig | None:
        return self._config

    @property
    def ready(self) -> bool:
        """True once a snapshot has been stored: Envoys connecting now get a full config."""
        return self.snapshot is not None

    def submit(self, config: RoutingConfig) -> None:
        """Accept a validated config; it is applied after the debounce period. The same
        config as the one in force changes nothing, except that it clears the error of a
        config refused since (the source is good again)."""
        if config == self._config:
            if self._refused:
                logger.info("Routing config accepted again, unchanged; the last error is cleared.")
                self._accepted()
            return
        logger.info("Routing config accepted: %d pools.", len(config.pools))
        self._accepted()
        if self._first_config_at is None:
            self._first_config_at = self._clock()
        self._config = _unchanged_pools_kept(config, self._config)
        self._schedule(extend=True)

    def _accepted(self) -> None:
        self._telemetry.config_reloads.labels("ok").inc()
        self._telemetry.config_last_reload_ok.set(1)
        self.last_error = None
        self._refused = False

    def metrics_changed(self) -> None:
        """New pod metrics arrived; decide again within `debounce_s` (not extended by more)."""
        if self._config is not None:
            self._schedule(extend=False)

    def peers_changed(self) -> None:
        """A peer replica's report of its Envoys' load arrived (or a peer came or went);
        decide within `debounce_s` (not extended by more)."""
        if self._config is not None:
            self._schedule(extend=False)

    def envoy_connected(self, _node_id: str) -> None:
        """An Envoy identified itself on an ADS stream. With flow control, decide now: until
        a decision names it, it enforces only the floor of each band. (At most every
        LOAD_DECISION_GAP_S: a storm of connects is folded into a few decisions.)"""
        config = self._config
        if config is not None and config.flow_control.enabled:
            self._schedule_soon()

    def envoy_rejected(self, node_id: str, resource_type: ResourceType, error: str) -> None:
        """An Envoy NACKed a response. One that refuses a pool's spill listener (its
        bootstrap lacks `envoy.bootstrap.internal_listener`, say) would send the keys of a
        spilling pod to a listener it does not have, and fail them: from then on, while
        this server runs, every Envoy is sent the `spill_to: ring` config instead (a
        spilling pod's keys go to the next pod of their Maglev permutation), which every
        Envoy takes. Logged and exported (`xds_spill_to_ring_fallback`)."""
        config = self._config
        if (
            resource_type is not ResourceType.LISTENER
            or config is None
            or self.spill_fallback is not None
        ):
            return
        refused = [
            names.spill_listener_name(p.name)
            for p in config.pools
            if config.spills(p) and f"'{names.spill_listener_name(p.name)}'" in error
        ]
        if not refused:
            return
        reason = error.strip()[:_MAX_REASON_CHARS]
        self.spill_fallback = f"node {node_id!r} refused {', '.join(refused)}: {reason}"
        self._telemetry.spill_to_ring.set(1)
        logger.warning(
            "Node %r refused the spill listener %s; without it, the keys of a spilling pod"
            " would fail there. Every Envoy now gets `balancing.spill_to: ring` (a spilling"
            " pod's keys go to the next pod of their ring) until this server restarts.",
            node_id,
            ", ".join(refused),
        )
        self._schedule(extend=False, now=True)

    def _in_force(self, config: RoutingConfig) -> RoutingConfig:
        """`config` as sent to Envoy: with `spill_to` "ring" once an Envoy refused a spill
        listener (`envoy_rejected`)."""
        if self.spill_fallback is None or config.balancing.spill_to == "ring":
            return config
        if self._ring_config is None or self._ring_config[0] is not config:
            balancing = config.balancing.model_copy(update={"spill_to": "ring"})
            self._ring_config = (config, config.model_copy(update={"balancing": balancing}))
        return self._ring_config[1]

    def load_changed(self, clusters: Set[str]) -> None:
        """The Envoys' access log or load reports changed the requests in flight per endpoint
        of `clusters`. When they carry long prompts, decide now, without debounce: a pod
        that just took a long prefill should get no more short requests, and each fraction
        of a second sends it more."""
        config = self._config
        if config is None:
            return
        if any(c in clusters for p in config.pools for c in names.long_prompt_clusters(config, p)):
            self._schedule_soon()

    def _note_clipped(self, decision: Decision) -> None:
        """Log and count the Envoys whose load reports a decision did not believe (more
        in flight than the pool's pods hold: policy/admission.plausible_load), once per
        Envoy and pool while it goes on."""
        clipped = {
            (pool, node): excess
            for pool, admission in decision.admissions.items()
            for node, excess in admission.clipped.items()
        }
        for (pool, node), excess in sorted(clipped.items()):
            if (pool, node) not in self._clipped:
                self._telemetry.lrs_implausible_reports.inc()
                logger.warning(
                    "Envoy %r reports %d more requests in flight on pool %r than its pods"
                    " hold beyond the other Envoys' reports; that part is not believed (the"
                    " other Envoys' limits stand).",
                    node, excess, pool,
                )  # fmt: skip
        self._clipped = set(clipped)

    def verdicts_changed(self) -> None:
        """A pod was judged stalled or failing from the Envoys' reports, or came back
        (verdicts.py): decide now, as for a long prompt."""
        if self._config is not None:
            self._schedule_soon()

    def keys_changed(self, pools: Set[str]) -> None:
        """The Envoys' session-key log named a key new to its pod (a new key, or one that
        moved) in `pools`: in a pool keeping key buckets, decide within `debounce_s` (not
        extended by more), as for new metrics. Its bucket is pinned, and its pod passed
        over by new keys (`balancing.new_key_prefill_s`), though its pods' pages did not
        move (quiet pods are scraped less often). Not at once, as for a long prompt: new
        keys can come many a second, and the debounce is what bounds the pushes."""
        config = self._config
        if config is not None and any(
            p.name in pools and config.bucket_homes(p) for p in config.pools
        ):
            self._schedule(extend=False)

    def _schedule_soon(self) -> None:
        """Decide at once, but at most every LOAD_DECISION_GAP_S, or the last decision's
        own duration if longer: a stream of load changes or connects (however many
        Envoys) cannot push Envoys more often than that, nor keep the loop deciding more
        than half the time (a rollout of 500 Envoys is a few dozen decisions, not 500). A
        decision due by then reads the latest inputs: nothing more to schedule."""
        gap = max(LOAD_DECISION_GAP_S, self._last_decision_s)
        at = max(self._clock(), self._last_load_decision + gap)
        if self._dirty_since is not None and self._deadline <= at:
            return
        self._last_load_decision = at
        self._schedule(extend=False, now=True, at=at)

    def reject(self, error: ConfigError) -> None:
        """Record a config that could not be used; the last good one stays in force."""
        logger.error("%s. Keeping the last good routing config.", error)
        self._telemetry.config_reloads.labels("error").inc()
        self._telemetry.config_last_reload_ok.set(0)
        self.last_error = str(error)
        self._refused = True

    def _schedule(self, *, extend: bool, now: bool = False, at: float | None = None) -> None:
        """Mark the state dirty: decide at `at` (default: the clock now) if `now`, else
        after the debounce (`extend`: a config change pushes the deadline out)."""
        assert self._config is not None
        updates = self._config.updates
        clock_now = self._clock()
        if now:
            self._dirty_since = self._dirty_since if self._dirty_since is not None else clock_now
            self._deadline = max(clock_now, at if at is not None else clock_now)
        elif self._dirty_since is None:
            self._dirty_since = clock_now
            self._deadline = clock_now + updates.debounce_s
        elif extend:
            self._deadline = min(
                clock_now + updates.debounce_s, self._dirty_since + updates.max_delay_s
            )
        self._settled.clear()
        self._wake.set()

    async def settled(self) -> Snapshot | None:
        """Wait until no accepted change is pending; returns the snapshot then in force."""
        await self._settled.wait()
        return self.snapshot

    def _redecide_interval(self) -> float | None:
        config = self._config
        if config is None:
            return None
        scored = self._signals is not None and any(p.weights_from_metrics for p in config.pools)
        admitted = self._load is not None and config.flow_control.enabled
        remote = any(p.remotes for p in config.pools)
        return config.balancing.scrape_interval_s if scored or admitted or remote else None

    async def run(self) -> None:
        """Apply changes until cancelled."""
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that
            # comes in the pass that wakes it, and the server's shutdown then waits forever.
            try:
                async with asyncio.timeout(self._redecide_interval()):
                    await self._wake.wait()
            except TimeoutError:
                self.metrics_changed()
            self._wake.clear()
            # The deadline may move while we sleep (a debounced config change extends it).
            # Within a millisecond is on time: a clock that rounds (looptime's) could
            # otherwise keep a sub-resolution remainder forever.
            while (delay := self._deadline - self._clock()) > 0.001:  # noqa: ASYNC110
                await asyncio.sleep(delay)
            await self._apply()

    def _internal_error(self, doing: str, exc: Exception) -> None:
        """A bug while `doing`: logged with its traceback and counted; the last snapshot
        stays in force."""
        logger.exception(
            "Internal error while %s; keeping the last snapshot. Please report.", doing
        )
        self._telemetry.config_reloads.labels("error").inc()
        self.last_error = f"internal error: {exc!r}"

    def _inputs(self, config: RoutingConfig) -> DecisionInputs:
        return DecisionInputs(
            config=config,
            signals=self._signals(self._clock()) if self._signals is not None else None,
            load=self._load.fleet_load(config) if self._load is not None else None,
            session_keys=_NO_SESSION_KEYS if self._session_keys is None else self._session_keys(),
            followed_homes=(_NO_HOMES if self._followed_homes is None else self._followed_homes()),
            served_by=_NO_SERVED_BY if self._served_by is None else self._served_by(),
            key_returns=_NO_RETURNS if self._key_returns is None else self._key_returns(),
            first_requests=(
                _NO_FIRSTS
                if self._first_requests is None
                else self._first_requests(config.balancing.new_key_prefill_s)
            ),
            followed_buckets=(
                _NO_BUCKETS if self._followed_buckets is None else self._followed_buckets()
            ),
        )

    def home_buckets(self) -> HomeBuckets:
        """Per pool that keeps key buckets, each endpoint's pinned buckets and the endpoints
        new keys go to, as this replica pushed them: what the replicas that follow it take
        (peering/links.py)."""
        config, decision = self._config, self.decision
        if config is None:
            return {}, {}
        buckets: dict[str, dict[str, tuple[int, ...]]] = {}
        spares: dict[str, tuple[str, ...]] = {}
        for pool in config.pools:
            state = decision.pools.get(pool.name)
            if state is None or not config.bucket_homes(pool):
                continue
            buckets[pool.name] = {e.id: e.key_buckets for e in state.endpoints if e.key_buckets}
            spares[pool.name] = tuple(sorted(e.id for e in state.endpoints if e.key_spare))
        return buckets, spares

    def home_factors(self) -> dict[str, dict[str, float]]:
        """Per session pool, each endpoint's ring-weight factor as this replica holds it
        (1 when absent): what the replicas that follow it take (peering/links.py)."""
        config = self._config
        if config is None:
            return {}
        return {
            pool.name: dict(self._memory.pools[pool.name].homes.factors)
            for pool in config.pools
            if pool.session_affinity and pool.name in self._memory.pools
        }

    def _warming(self, config: RoutingConfig, inputs: DecisionInputs) -> bool:
        """Before the first snapshot: some pod of a GPU-aware pool has no scrape verdict
        yet, and the first config came less than a scrape timeout and interval ago.

        A restarted server (or a new replica) that pushed before its pods were scraped would
        push its pods out of rotation (a pod never scraped gets no traffic) and then back:
        Envoy would be sent twice what it already holds, and traffic would shift meanwhile.
        Waiting for the pods' first word makes the first snapshot the one the server had
        before, byte for byte, while nothing changed.
        """
        if self.snapshot is not None or inputs.signals is None or self._first_config_at is None:
            return False
        balancing = config.balancing
        grace = balancing.scrape_timeout_s + balancing.scrape_interval_s
        if self._clock() - self._first_config_at >= grace:
            return False
        expected = {
            endpoint_id(e) for p in config.pools if p.weights_from_metrics for e in p.endpoints
        }
        return not expected <= inputs.signals.keys()

    async def _apply(self) -> None:
        assert self._config is not None
        config = self._in_force(self._config)
        inputs = self._inputs(config)
        if self._warming(config, inputs):
            # Decide again on the next scrape (metrics_changed) or interval, whichever first.
            self._dirty_since = None
            return
        self._dirty_since = None
        started = time.perf_counter()
        try:
            await self._decide_and_build(config, inputs)
        finally:
            self._last_decision_s = time.perf_counter() - started
            # Settled unless a change came while this one was worked out in slices.
            if self._dirty_since is None:
                self._settled.set()

    async def _decide_and_build(self, config: RoutingConfig, inputs: DecisionInputs) -> None:
        decided_on = (
            config,
            inputs.signals,
            inputs.load,
            inputs.session_keys,
            inputs.followed_homes,
            inputs.served_by,
            inputs.key_returns,
            inputs.first_requests,
            inputs.followed_buckets,
        )
        last = self._decided_on
        if (
            self._memory_settled
            and last is not None
            and all(a is b for a, b in zip(last, decided_on, strict=True))
        ):
            decision = self.decision
        else:
            try:
                decision, memory = await _sliced(self._decider.steps(inputs, self._memory))
            except Exception as exc:  # a bug: say so, keep serving the last snapshot, go on
                self._internal_error("deciding", exc)
                return
            self._memory_settled = memory == self._memory
            self._memory, self._decided_on = memory, decided_on
            self._note_clipped(decision)
        try:
            decision = self._with_failover(config, decision, inputs)
        except Exception as exc:  # a bug: say so, keep serving the last snapshot, go on
            self._internal_error("planning failover", exc)
            return
        if decision is self.decision and self._built is not None:
            return
        self.decision = decision
        if self._built is not None and self._built == (config, decision):
            return
        started = time.perf_counter()
        try:
            snapshot = await _sliced(self._builder.build_steps(config, decision))
            own = await _sliced(self._builder.for_envoys_steps(config, decision, snapshot))
        except XdsServerError as exc:
            logger.error(
                "Could not build a snapshot from the routing config: %s. Keeping the last one.", exc
            )
            self._telemetry.config_reloads.labels("error").inc()
            self.last_error = str(exc)
            return
        except Exception as exc:  # a bug: say so, keep serving the last snapshot, go on
            self._internal_error("building a snapshot", exc)
            return
        self._built = (config, decision)
        self._telemetry.snapshot_build_duration.observe(time.perf_counter() - started)
        if self._cache.set_snapshot(snapshot, group=self._group, nodes=own):
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

    def _with_failover(
        self, config: RoutingConfig, decision: Decision, inputs: DecisionInputs
    ) -> Decision:
        """`decision` with the failover of every pool with remotes planned now
        (policy/failover.py); the same object when the plan did not change."""
        views = self._remotes.views(config) if self._remotes is not None else {}
        now = self._clock()
        planned: dict[str, PoolFailover] = {}
        memories: dict[str, FailoverMemory] = {}
        for pool in config.pools:
            if not pool.remotes:
                continue
            before = self.failover_memory.get(pool.name, FailoverMemory())
            planned[pool.name], memories[pool.name] = plan_pool(
                pool,
                decision.pools.get(pool.name),
                inputs.signals or {},
                remotes=views.get(pool.name, {}),
                flow_control=config.flow_control,
                memory=before,
                now=now,
            )
            _log_failover(pool.name, before, memories[pool.name], planned[pool.name])
        self.failover_memory = memories
        # A pool sending traffic to remotes is not admitted by its band limits: they are
        # its own pods' capacity, which would refuse what the remotes can take (the
        # remote gateways admit by their own budgets).
        admitted = {
            pool: admission
            for pool, admission in decision.admissions.items()
            if pool not in planned or not planned[pool].active
        }
        if planned == decision.failover and len(admitted) == len(decision.admissions):
            return decision
        return dataclasses.replace(decision, failover=planned, admissions=admitted)


def _log_failover(
    pool: str, before: FailoverMemory, after: FailoverMemory, plan: PoolFailover
) -> None:
    if before.share >= 1.0 > after.share:
        logger.warning(
            "Pool %r fails over to its remotes (%s): local share %.2f.",
            pool, plan.reason, after.share,
        )  # fmt: skip
    elif after.share >= 1.0 > before.share:
        logger.info("Pool %r is back on its own pods: every request stays local.", pool)
    elif after.share != before.share:
        logger.info("Pool %r: local share %.2f (%s).", pool, after.share, plan.reason)


def _unchanged_pools_kept(config: RoutingConfig, before: RoutingConfig | None) -> RoutingConfig:
    """`config` with each pool equal to one of `before` replaced by that very object: the
    policy, the builders and their caches (per pool) then tell an unchanged pool by
    identity, and a one-pool edit of a 100-pool config rebuilds one pool, once, instead of
    comparing 10,000 endpoints at every step."""
    if before is None:
        return config
    known = {pool.name: pool for pool in before.pools}
    pools = tuple(
        known[pool.name] if known.get(pool.name) == pool else pool for pool in config.pools
    )
    if all(a is b for a, b in zip(pools, config.pools, strict=True)):
        return config
    return config.model_copy(update={"pools": pools})


async def _sliced(steps: Steps[T]) -> T:
    """Run `steps` (steps.py), handing the event loop back whenever a slice has run
    SLICE_S: a decision or build at fleet size never holds ADS, LRS and probes for long."""
    started = time.perf_counter()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if time.perf_counter() - started > SLICE_S:
            await asyncio.sleep(0)
            started = time.perf_counter()
