"""The policy as one pure function: what Envoy should hold, from what is known now.

    decide(inputs, memory) -> (Decision, PolicyMemory)

Inputs are the routing config, every scraped pod's signals (by endpoint id, their ages
measured at the instant the controller decides, on its clock: time enters here only as
those ages) and the load the Envoys report, already keyed by pool, band and endpoint id
(fleet_load.py translates Envoy's cluster names once, before this is called). The
policy's memory (smoothed scores, LoRA adapter placement and activity, the pods spilling
session keys, per pool) goes in and its next value comes out, so nothing here is kept
between calls: the controller holds the memory and hands it back.

The Decision speaks the policy's language, not Envoy's: endpoint states per pool (weights,
health, adapters) and, with flow control, each pool's admission (per band: its fleet-wide
budget, the limit each Envoy enforces, and the Retry-After). Turning it into clusters,
runtime keys and routes is the job of `xds_server.envoy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from xds_server.config import PoolConfig, RoutingConfig
from xds_server.policy.admission import BandLoad, PodCapacity, PodsHeld, PoolAdmission, admit
from xds_server.policy.affinity import AffinityMemory
from xds_server.policy.buckets import BucketMemory, FollowedBuckets
from xds_server.policy.failover import PoolFailover
from xds_server.policy.homes import HomeMemory
from xds_server.policy.scoring import score_pool
from xds_server.policy.signals import PodSignals, endpoint_id
from xds_server.policy.state import Health, PoolState
from xds_server.steps import Steps, complete

__all__ = [
    "Decider",
    "Decision",
    "DecisionInputs",
    "FleetLoad",
    "PolicyMemory",
    "PoolLoad",
    "PoolMemory",
    "decide",
]

_EMPTY: Mapping[str, int] = MappingProxyType({})
_NO_SIGNALS: Mapping[str, PodSignals] = MappingProxyType({})
_NO_VERDICTS: Mapping[str, str] = MappingProxyType({})
_NO_SLOWNESS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, kw_only=True)
class PoolLoad:
    """What every connected Envoy reports of one pool, summed over them."""

    # Requests in flight per band, completions and admissions per second (LRS).
    bands: BandLoad
    # Long prompts still holding each pod (endpoint id "address:port"): prefilling as the
    # access log tells, or in flight as the load reports of Envoys that do not log tell.
    long_prompts: Mapping[str, int] = field(default_factory=dict)
    # Pods the Envoys' reports show stalled or failing (endpoint id -> reason): out of
    # rotation whatever their metrics say (verdicts.py).
    verdicts: Mapping[str, str] = field(default_factory=dict)
    # Pods slower per request than their peers (endpoint id -> steps of slowness): the KV
    # capacity they claim beyond their peers' is not believed.
    slowness: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FleetLoad:
    """The load of every pool over the fleet's Envoys, and the part of each budget held
    back for Envoys not seen (those of server replicas this one has no word from)."""

    pools: Mapping[str, PoolLoad] = field(default_factory=dict)
    reserved: float = 0.0


@dataclass(frozen=True, kw_only=True)
class PoolMemory:
    """What the policy remembers of a pool between decisions (scoring.py, adapters.py,
    homes.py, affinity.py)."""

    scores: Mapping[str, float] = field(default_factory=dict)
    placement: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    adapter_activity: Mapping[str, float] = field(default_factory=dict)
    spilled: frozenset[str] = frozenset()
    homes: HomeMemory = field(default_factory=HomeMemory)
    affinity: AffinityMemory = field(default_factory=AffinityMemory)
    buckets: BucketMemory = field(default_factory=BucketMemory)


@dataclass(frozen=True, kw_only=True)
class PolicyMemory:
    """The policy's memory of every GPU-aware pool; empty at start."""

    pools: Mapping[str, PoolMemory] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class DecisionInputs:
    """Everything a decision depends on besides memory.

    `signals` is None when no metrics are scraped at all (pools keep their configured
    endpoints); `load` is None when no load reports are collected (no flow control);
    `session_keys` holds, per pool, the hashes of the session keys its Envoys logged and
    their recent requests (xds/session_keys.py; empty when none are logged);
    `followed_homes`, per session pool, the ring-weight factors of the replica this one
    follows (homes.followed_homes; empty when it places its own); `served_by`, per pool,
    the pod (endpoint id) each key its own Envoys logged was last served by (buckets.py);
    `key_returns`, per pool, per pod, the share of the keyed requests it was sent that
    returned to it (affinity.py; absent: not known); `first_requests`, per pool, per pod,
    the keys whose first request on it its own Envoys logged within
    `balancing.new_key_prefill_s` (buckets.py: new keys go to the pods with fewest);
    `followed_buckets`, per pool that keeps key buckets, the table of the replica this
    one follows (empty when it keeps its own).
    """

    config: RoutingConfig
    signals: Mapping[str, PodSignals] | None = None
    load: FleetLoad | None = None
    session_keys: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    followed_homes: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    served_by: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    key_returns: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    first_requests: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    followed_buckets: Mapping[str, FollowedBuckets] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What Envoy should hold: endpoint states per GPU-aware pool (a pool absent here takes
    its endpoints from config), per pool with flow control its admission, and per pool
    with remotes its failover (failover.py: the controller plans it after `decide`, as
    it depends on time and on the remotes' summaries)."""

    pools: Mapping[str, PoolState] = field(default_factory=dict)
    admissions: Mapping[str, PoolAdmission] = field(default_factory=dict)
    failover: Mapping[str, PoolFailover] = field(default_factory=dict)


def decide(inputs: DecisionInputs, memory: PolicyMemory) -> tuple[Decision, PolicyMemory]:
    """The decision for `inputs`, and the memory to pass to the next call.

    Pure: the same inputs and memory give the same decision and memory.
    """
    return Decider().decide(inputs, memory)


# What one pool's scoring and admission are computed from (Decider).
_ScoringKey = tuple[object, ...]
_AdmissionKey = tuple[object, ...]


class Decider:
    """`decide`, paying only for the pools whose inputs changed.

    At fleet size (a hundred pools, hundreds of Envoys) a decision is mostly pools whose
    pods and load did not move since the last one; each pool's scoring and admission are
    pure functions of its own inputs, so a pool whose inputs equal last time's gets last
    time's results, the same objects. `Decider().decide(...)` gives exactly what `decide`
    gives, whatever was decided before (tests/policy/test_decision.py checks it).

    Mutable state, per pool: its endpoint ids with the pool config they are of, and the
    inputs and results of its last scoring and admission.
    """

    def __init__(self) -> None:
        self._ids: dict[str, tuple[PoolConfig, tuple[str, ...]]] = {}
        self._scored: dict[str, tuple[_ScoringKey, PoolState, PoolMemory]] = {}
        self._admitted: dict[str, tuple[_AdmissionKey, PoolAdmission]] = {}

    def _endpoint_ids(self, pool: PoolConfig) -> tuple[str, ...]:
        known = self._ids.get(pool.name)
        if known is None or known[0] is not pool:
            known = self._ids[pool.name] = (pool, tuple(endpoint_id(e) for e in pool.endpoints))
        return known[1]

    def decide(self, inputs: DecisionInputs, memory: PolicyMemory) -> tuple[Decision, PolicyMemory]:
        """As `decide`."""
        return complete(self.steps(inputs, memory))

    def steps(
        self, inputs: DecisionInputs, memory: PolicyMemory
    ) -> Steps[tuple[Decision, PolicyMemory]]:
        """`decide` in steps, one per pool decided anew (steps.py)."""
        config, signals, load = inputs.config, inputs.signals, inputs.load
        own_signals: dict[str, Mapping[str, PodSignals]] = {}
        if signals is not None:
            for pool in config.pools:
                own_signals[pool.name] = {
                    key: signals[key] for key in self._endpoint_ids(pool) if key in signals
                }
        pools: dict[str, PoolState] = {}
        remembered: dict[str, PoolMemory] = {}
        if signals is not None:
            for pool in config.pools:
                if pool.weights_from_metrics:
                    fresh = self._score(pool, config, own_signals[pool.name], load, inputs, memory)
                    pools[pool.name], remembered[pool.name], new = fresh
                    if new:
                        yield
        admissions: dict[str, PoolAdmission] = {}
        if config.flow_control.enabled and load is not None:
            for pool in config.pools:
                admissions[pool.name], new = self._admit(
                    pool, config, pools.get(pool.name), own_signals, signals or {}, load
                )
                if new:
                    yield
        for cache in (self._ids, self._scored, self._admitted):
            for gone in cache.keys() - {p.name for p in config.pools}:
                del cache[gone]
        return Decision(pools=pools, admissions=admissions), PolicyMemory(pools=remembered)

    def _score(
        self,
        pool: PoolConfig,
        config: RoutingConfig,
        signals: Mapping[str, PodSignals],
        load: FleetLoad | None,
        inputs: DecisionInputs,
        memory: PolicyMemory,
    ) -> tuple[PoolState, PoolMemory, bool]:
        """The pool's endpoint states and memory, and whether they were decided anew."""
        previous = memory.pools.get(pool.name, PoolMemory())
        pool_load = load.pools.get(pool.name) if load is not None else None
        long_prompts = pool_load.long_prompts if pool_load is not None else _EMPTY
        verdicts = pool_load.verdicts if pool_load is not None else _NO_VERDICTS
        slowness = pool_load.slowness if pool_load is not None else _NO_SLOWNESS
        session_keys = inputs.session_keys.get(pool.name)
        followed = inputs.followed_homes.get(pool.name)
        served_by = inputs.served_by.get(pool.name)
        key_returns = inputs.key_returns.get(pool.name)
        first_requests = inputs.first_requests.get(pool.name)
        followed_table = inputs.followed_buckets.get(pool.name)
        key: _ScoringKey = (
            pool,
            config.balancing,
            signals,
            long_prompts,
            verdicts,
            slowness,
            session_keys,
            followed,
            served_by,
            key_returns,
            first_requests,
            followed_table,
            previous,
        )
        last = self._scored.get(pool.name)
        if last is not None and last[0] == key:
            return last[1], last[2], False
        scored = score_pool(
            pool,
            settings=config.balancing,
            signals=signals,
            long_prompts=long_prompts,
            verdicts=verdicts,
            slowness=slowness,
            memory=previous.scores,
            placement=previous.placement,
            adapter_activity=previous.adapter_activity,
            spilled=previous.spilled,
            homes=previous.homes,
            session_keys=session_keys,
            followed=followed,
            keys=previous.affinity,
            buckets=previous.buckets,
            served_by=served_by,
            key_returns=key_returns,
            first_requests=first_requests,
            followed_table=followed_table,
            draining={endpoint_id(e) for e in pool.endpoints if e.draining},
            tuning=config.tuning(pool),
        )
        remembered = PoolMemory(
            scores=scored.memory,
            placement=scored.placement,
            adapter_activity=scored.adapter_activity,
            spilled=scored.spilled,
            homes=scored.homes,
            affinity=scored.affinity,
            buckets=scored.buckets,
        )
        self._scored[pool.name] = (key, scored.state, remembered)
        return scored.state, remembered, True

    def _admit(
        self,
        pool: PoolConfig,
        config: RoutingConfig,
        state: PoolState | None,
        own_signals: Mapping[str, Mapping[str, PodSignals]],
        signals: Mapping[str, PodSignals],
        load: FleetLoad,
    ) -> tuple[PoolAdmission, bool]:
        """The pool's admission, and whether it was decided anew."""
        tuning = config.tuning(pool)
        # Limits stand about one interval, and reach Envoy within another.
        horizon_s = tuning.admission_horizon_intervals * config.balancing.scrape_interval_s
        pool_load = load.pools.get(pool.name)
        bands = pool_load.bands if pool_load is not None else BandLoad(in_flight={})
        key: _AdmissionKey = (
            pool,
            state,
            own_signals.get(pool.name, _NO_SIGNALS),
            bands,
            load.reserved,
            config.flow_control,
            horizon_s,
        )
        last = self._admitted.get(pool.name)
        if last is not None and last[0] == key:
            return last[1], False
        admission = admit(
            _capacity_inputs(pool, state, signals),
            load=bands,
            reserved=load.reserved,
            settings=config.flow_control,
            horizon_s=horizon_s,
            held=_held(self._endpoint_ids(pool), signals),
            tuning=tuning,
        )
        self._admitted[pool.name] = (key, admission)
        return admission, True


def _held(endpoints: tuple[str, ...], signals: Mapping[str, PodSignals]) -> PodsHeld | None:
    """What the pool's pods hold by their metrics; None unless every one has a page."""
    known = [signals.get(key) for key in endpoints]
    if not known or any(s is None or not s.scraped for s in known):
        return None
    return PodsHeld(
        requests=sum(s.running + s.waiting for s in known if s is not None), pods=len(known)
    )


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
