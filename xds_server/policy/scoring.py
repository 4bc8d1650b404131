"""A pool's endpoint states from its pods' signals: the policy's slow loop, one pool.

Envoy balances every request by these weights: by default (`balancing.active_request_bias`
0) with weighted round robin, which on equal weights is plain round robin; with a bias
above 0 with least request, by `weight / (active requests + 1)^bias`. What Envoy cannot
see is how fast each pod serves and whether it is saturated; the policy tells it, in
named stages (docs/routing.md):

1. rotation (health.py): which pods are in rotation, and why the others are not;
2. capacity (capacity.py): each pod's serving capacity relative to the pool's largest;
3. score (factors.py): capacity and load factors, smoothed (weights.py);
4. adapters (adapter_demand.py, adapters.py): where each LoRA adapter is advertised;
5. spilling (spill.py): which pods pass their session keys on, and why;
6. key homes (homes.py): ring weights nudged off capacity where keys' homes are uneven,
   or a table of key buckets (buckets.py), and whether sticking to them pays at all
   (affinity.py);
7. weights (weights.py): scores cut for long prompts and spills, scaled, quantized.

Each endpoint state carries the reasons the stages gave (reasons.py). Every number comes
from the pool's `Tuning` (xds_server/tuning.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from types import MappingProxyType

from xds_server.config import BalancingConfig, EndpointConfig, PoolConfig
from xds_server.maglev import table_size
from xds_server.policy.adapter_demand import activity_of, pool_placement
from xds_server.policy.affinity import Affinity, AffinityMemory, affinity
from xds_server.policy.buckets import (
    BucketHomes,
    BucketMemory,
    FollowedBuckets,
    bucket_homes,
    followed_buckets,
)
from xds_server.policy.capacity import relative_capacities
from xds_server.policy.factors import score, weight_cuts
from xds_server.policy.health import Rotation, rotation
from xds_server.policy.homes import HomeMemory, Homes, LoggedKeys, balanced_homes, followed_homes
from xds_server.policy.reasons import Reason
from xds_server.policy.signals import PodSignals, endpoint_id
from xds_server.policy.spill import Spilling, spilling
from xds_server.policy.state import EndpointState, PoolState
from xds_server.policy.weights import quantize, smoothed
from xds_server.tuning import MAX_WEIGHT, Tuning

__all__ = ["ScoredPool", "score_pool"]

_DEFAULT_TUNING = Tuning()
_NO_HOMES = HomeMemory()
_NO_BUCKETS = BucketMemory()
_STICKY = AffinityMemory()


@dataclass(frozen=True, kw_only=True)
class ScoredPool:
    state: PoolState
    # Smoothed scores by endpoint id, to pass back as `memory` next time; the adapter
    # placement (adapters.py; empty without adapters), to pass back as `placement`, and
    # each adapter's activity, to pass back as `adapter_activity`.
    memory: Mapping[str, float]
    placement: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    adapter_activity: Mapping[str, float] = field(default_factory=dict)
    # The pods spilling their session keys for load, to pass back as `spilled` (spill.py).
    spilled: frozenset[str] = frozenset()
    # The key homes' ring factors and window, to pass back as `homes` (homes.py).
    homes: HomeMemory = field(default_factory=HomeMemory)
    # The pinned key buckets, to pass back as `buckets` (buckets.py).
    buckets: BucketMemory = field(default_factory=BucketMemory)
    # Whether the keys stick, to pass back as `affinity` (affinity.py).
    affinity: AffinityMemory = field(default_factory=AffinityMemory)


def _scores(
    pool: PoolConfig,
    fresh: Mapping[str, PodSignals],
    capacities: Mapping[str, float],
    memory: Mapping[str, float],
    settings: BalancingConfig,
    tuning: Tuning,
) -> dict[str, float]:
    """Smoothed scores of the fresh pods; the others keep their last (if any)."""
    scores: dict[str, float] = {}
    for key in map(endpoint_id, pool.endpoints):
        if key in fresh:
            raw = score(fresh[key], capacities[key], settings, tuning)
            scores[key] = smoothed(raw, memory.get(key), settings.smoothing)
        elif key in memory:
            scores[key] = memory[key]
    return scores


def _weights(
    pool: PoolConfig,
    scores: Mapping[str, float],
    pods: Rotation,
    spilled: Spilling,
    long_prompts: Mapping[str, int],
    settings: BalancingConfig,
    tuning: Tuning,
) -> dict[str, float]:
    """Each pod's weight before scaling: its score, cut once per long prompt prefilling
    and once more when it spills for load (unkeyed requests sent to a full batch would
    wait for the slot its keys were moved off to spare). A pod without a score was never
    believed: the lowest weight, but when the pool fails open and it is not down, on a
    par with the others. A pod on probation has `probation_weight` times the median score
    of the pods scored anew (of all pods when none is, as when failing open), whatever
    its score before it restarted."""
    placeholder = (statistics.median(scores.values()) if scores else 1.0) if pods.fail_open else 0.0
    fresh = [scores[key] for key in pods.fresh if key in scores]
    reference = statistics.median(fresh) if fresh else placeholder or 1.0
    factor = settings.long_prompt_weight_factor
    return {
        key: (
            tuning.probation_weight * reference
            if key in pods.probation
            else scores.get(key, 0.0 if key in pods.down else placeholder)
        )
        * factor ** (long_prompts.get(key, 0) + (key in spilled.loaded))
        for key in map(endpoint_id, pool.endpoints)
    }


def _reasons(
    key: str,
    pods: Rotation,
    spilled: Spilling,
    capacities: Mapping[str, float],
    slowness: Mapping[str, int],
    homes: Homes | None,
    suspended: Reason | None,
    settings: BalancingConfig,
    tuning: Tuning,
) -> tuple[Reason, ...]:
    """Why the pod has its state: its health, its spill, its home share, what cut its
    score."""
    reasons = []
    health_reason = pods.health[key][1]
    if health_reason is not None:
        reasons.append(health_reason)
    if key in spilled.reasons:
        reasons.append(spilled.reasons[key])
    if homes is not None and key in homes.reasons:
        reasons.append(homes.reasons[key])
    if suspended is not None and key in pods.healthy:
        reasons.append(suspended)
    if key in pods.fresh:
        if slowness.get(key, 0) > 0:
            reasons.append(Reason("weight_slow", f"slower than its peers ({slowness[key]} steps)"))
        reasons.extend(weight_cuts(pods.fresh[key], capacities[key], settings, tuning))
    return tuple(reasons)


def _endpoint_state(
    endpoint: EndpointConfig,
    *,
    weight: int,
    ring_weight: int | None,
    adapters: tuple[str, ...],
    pods: Rotation,
    spilled: Spilling,
    long_prompts: Mapping[str, int],
    reasons: tuple[Reason, ...],
    table: BucketHomes | None,
) -> EndpointState:
    key = endpoint_id(endpoint)
    return EndpointState(
        address=endpoint.address,
        port=endpoint.port,
        name=endpoint.name,
        weight=weight,
        ring_weight=ring_weight,
        health=pods.health[key][0],
        adapters=adapters,
        hardware=endpoint.hardware,
        long_prompts=long_prompts.get(key, 0),
        spilling=key in spilled.pods,
        verdict=pods.verdicts.get(key),
        reasons=reasons,
        key_buckets=table.buckets.get(key, ()) if table is not None else (),
        key_offers=table.offers.get(key, ()) if table is not None else (),
        key_spare=table is not None and key in table.spares,
    )


def score_pool(
    pool: PoolConfig,
    *,
    settings: BalancingConfig,
    signals: Mapping[str, PodSignals],
    memory: Mapping[str, float],
    draining: Set[str] = frozenset(),
    placement: Mapping[str, tuple[str, ...]] = MappingProxyType({}),
    adapter_activity: Mapping[str, float] = MappingProxyType({}),
    long_prompts: Mapping[str, int] = MappingProxyType({}),
    spilled: Set[str] = frozenset(),
    verdicts: Mapping[str, str] = MappingProxyType({}),
    slowness: Mapping[str, int] = MappingProxyType({}),
    homes: HomeMemory = _NO_HOMES,
    session_keys: Mapping[int, float] | None = None,
    followed: Mapping[str, float] | None = None,
    keys: AffinityMemory = _STICKY,
    buckets: BucketMemory = _NO_BUCKETS,
    served_by: Mapping[int, str] | None = None,
    key_returns: Mapping[str, float] | None = None,
    first_requests: Mapping[str, int] | None = None,
    followed_table: FollowedBuckets | None = None,
    tuning: Tuning = _DEFAULT_TUNING,
) -> ScoredPool:
    """The pool's endpoint states from its pods' `signals` (by endpoint id).

    `memory`, `placement`, `adapter_activity`, `spilled`, `homes`, `keys` (affinity) and
    `buckets` are the previous call's; `served_by` the pod each logged key was last
    served by (endpoint ids, where the Envoys said: buckets.py pins by it); `key_returns`
    per pod the share of the keyed requests it was sent that returned to it (affinity.py;
    None: not known); `first_requests` per pod the keys whose first request on it was
    logged lately (buckets.py: new keys go to the pods with fewest; None: none);
    `followed_table` the key buckets of the replica this one follows (None: its own);
    `session_keys` the hashes of the session keys the Envoys logged and their recent
    requests (homes.py places them; None: none logged)
    (empty at first); `followed` the ring-weight factors of the replica this one follows
    (homes.followed_homes; None: this replica places its own); `draining` lists endpoints
    being shut down; `long_prompts` the long prompts in flight per endpoint id;
    `verdicts` the pods the Envoys' reports show stalled or failing (by endpoint id: the
    reason), which are out of rotation like a pod known to be down; `slowness` the pods
    slower per request than their peers (steps), whose claims beyond their peers' are not
    believed (capacity.py). Pure: the same inputs give the same output.
    """
    pods = rotation(
        pool,
        signals,
        settings,
        tuning,
        long_prompts=long_prompts,
        verdicts=verdicts,
        draining=draining,
    )
    believed = {k: s for k, s in signals.items() if s.scraped and k not in pods.unbelieved}
    capacities = relative_capacities(pool.endpoints, believed, settings, slowness, tuning)
    scores = _scores(pool, pods.fresh, capacities, memory, settings, tuning)
    activity: dict[str, float] = {}
    placed: dict[str, tuple[str, ...]] = {}
    if pool.adapters:
        activity = activity_of(pool.adapters, pods.healthy, signals, adapter_activity, tuning)
        placed = pool_placement(
            pool, pods.healthy, signals, scores, placement, activity, settings, tuning, capacities
        )
    spill = spilling(
        pods.healthy,
        pods.fresh,
        capacities,
        spilled=spilled,
        long_prompts=long_prompts,
        session_affinity=pool.session_affinity,
        limit=pool.batch_limit,
        settings=settings,
        tuning=tuning,
    )
    weighed = _weights(pool, scores, pods, spill, long_prompts, settings, tuning)
    top = max(weighed.values(), default=1.0) or 1.0
    rings = _ring_weights(
        pool, pods, capacities, spill.loaded, homes, session_keys, followed, settings, tuning
    )
    table = None
    known = {endpoint_id(e) for e in pool.endpoints}
    if settings.keeps_buckets(pool) and followed_table is not None:
        table = followed_buckets(
            known,
            pods.healthy,
            followed_table,
            buckets=settings.key_buckets,
            offer_points=tuning.key_offer_points,
            offer_width=tuning.key_offer_width,
        )
    elif settings.keeps_buckets(pool):
        table = bucket_homes(
            known,
            pods.healthy,
            _ring_base(pods, capacities, settings, tuning),
            session_keys,
            served_by,
            spill.loaded,
            buckets,
            buckets=settings.key_buckets,
            key_prior=tuning.home_key_prior,
            offer_points=tuning.key_offer_points,
            offer_width=tuning.key_offer_width,
            spare_slack=tuning.key_spare_slack,
            first_requests=first_requests,
        )
    sticks = _affinity(pool, pods, keys, settings, tuning, key_returns)
    suspended = sticks.reason if sticks is not None else None
    states = []
    for endpoint in pool.endpoints:
        key = endpoint_id(endpoint)
        observed = signals.get(key)
        states.append(
            _endpoint_state(
                endpoint,
                weight=quantize(MAX_WEIGHT * weighed[key] / top, tuning.weight_ladder),
                ring_weight=rings[1].get(key),
                adapters=placed[key]
                if key in placed
                else tuple(sorted(observed.adapters))
                if observed is not None
                else (),
                pods=pods,
                spilled=spill,
                long_prompts=long_prompts,
                reasons=_reasons(
                    key, pods, spill, capacities, slowness, rings[0], suspended, settings, tuning
                ),
                table=table,
            )
        )
    return ScoredPool(
        state=PoolState(
            name=pool.name, endpoints=tuple(states), keys_suspended=suspended is not None
        ),
        memory=scores,
        placement=placed,
        adapter_activity=activity,
        spilled=spill.loaded,
        homes=rings[0].memory if rings[0] is not None else _NO_HOMES,
        buckets=table.memory if table is not None else _NO_BUCKETS,
        affinity=sticks.memory if sticks is not None else _STICKY,
    )


def _affinity(
    pool: PoolConfig,
    pods: Rotation,
    memory: AffinityMemory,
    settings: BalancingConfig,
    tuning: Tuning,
    key_returns: Mapping[str, float] | None,
) -> Affinity | None:
    """Whether a session pool's keys stick (affinity.py). Only where their requests can be
    passed on to the pool's cluster (`spill_to: pool`, the spill listener): with `ring`
    there is nowhere else to send them."""
    if not pool.session_affinity or settings.spill_to != "pool":
        return None
    return affinity(pods.healthy, pods.fresh, memory, tuning, key_returns)


def _ring_base(
    pods: Rotation, capacities: Mapping[str, float], settings: BalancingConfig, tuning: Tuning
) -> dict[str, float]:
    """Each pod's ring weight from capacity (any scale), cut on probation."""
    return {
        key: capacities[key] ** settings.scorers.capacity
        * (tuning.probation_weight if key in pods.probation else 1.0)
        for key in capacities
    }


def _ring_weights(
    pool: PoolConfig,
    pods: Rotation,
    capacities: Mapping[str, float],
    spilling: Set[str],
    memory: HomeMemory,
    session_keys: Mapping[int, float] | None,
    followed: Mapping[str, float] | None,
    settings: BalancingConfig,
    tuning: Tuning,
) -> tuple[Homes | None, dict[str, int]]:
    """A session pool's key homes and ring weights: capacity, times each pod's home factor
    (scaled so that the largest factor is 1), times `probation_weight` on probation;
    nothing for a pool without session affinity. A pool that keeps its keys in buckets
    has no home factors: its ring weights only spread new keys over the spares."""
    if not pool.session_affinity:
        return None, {}
    base = _ring_base(pods, capacities, settings, tuning)

    def weights(factors: Mapping[str, float]) -> dict[str, int]:
        top = max((factors.get(key, 1.0) for key in base), default=1.0)
        return {
            key: quantize(MAX_WEIGHT * share * factors.get(key, 1.0) / top, tuning.weight_ladder)
            for key, share in base.items()
        }

    if settings.keeps_buckets(pool):
        return None, weights({})
    keys = None
    # With `spill_to: ring` the table is Envoy's largest (maglev.py): its keys are not placed.
    if session_keys and settings.spill_to == "pool":
        keys = LoggedKeys(
            counts=session_keys,
            names={endpoint_id(e): e.ring_key for e in pool.endpoints},
            size=table_size(len(pool.endpoints)),
            weights=weights,
        )
    if followed is not None:
        homes = followed_homes(pods.healthy, followed)
    else:
        homes = balanced_homes(pods.healthy, pods.fresh, base, spilling, memory, tuning, keys)
    return homes, weights(homes.memory.factors)
