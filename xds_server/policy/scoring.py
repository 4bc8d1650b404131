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
6. weights (weights.py): scores cut for long prompts and spills, scaled, quantized.

Each endpoint state carries the reasons the stages gave (reasons.py). Every number comes
from the pool's `Tuning` (xds_server/tuning.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from types import MappingProxyType

from xds_server.config import BalancingConfig, EndpointConfig, PoolConfig
from xds_server.policy.adapter_demand import activity_of, pool_placement
from xds_server.policy.capacity import relative_capacities
from xds_server.policy.factors import score, weight_cuts
from xds_server.policy.health import Rotation, rotation
from xds_server.policy.reasons import Reason
from xds_server.policy.signals import PodSignals, endpoint_id
from xds_server.policy.spill import Spilling, spilling
from xds_server.policy.state import EndpointState, PoolState
from xds_server.policy.weights import quantize, smoothed
from xds_server.tuning import MAX_WEIGHT, Tuning

__all__ = ["ScoredPool", "score_pool"]

_DEFAULT_TUNING = Tuning()


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
) -> dict[str, float]:
    """Each pod's weight before scaling: its score, cut once per long prompt prefilling
    and once more when it spills for load (unkeyed requests sent to a full batch would
    wait for the slot its keys were moved off to spare). A pod without a score was never
    believed: the lowest weight, but when the pool fails open and it is not down, on a
    par with the others."""
    placeholder = (statistics.median(scores.values()) if scores else 1.0) if pods.fail_open else 0.0
    factor = settings.long_prompt_weight_factor
    return {
        key: scores.get(key, 0.0 if key in pods.down else placeholder)
        * factor ** (long_prompts.get(key, 0) + (key in spilled.loaded))
        for key in map(endpoint_id, pool.endpoints)
    }


def _reasons(
    key: str,
    pods: Rotation,
    spilled: Spilling,
    capacities: Mapping[str, float],
    slowness: Mapping[str, int],
    settings: BalancingConfig,
    tuning: Tuning,
) -> tuple[Reason, ...]:
    """Why the pod has its state: its health, its spill, what cut its score."""
    reasons = []
    health_reason = pods.health[key][1]
    if health_reason is not None:
        reasons.append(health_reason)
    if key in spilled.reasons:
        reasons.append(spilled.reasons[key])
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
    tuning: Tuning = _DEFAULT_TUNING,
) -> ScoredPool:
    """The pool's endpoint states from its pods' `signals` (by endpoint id).

    `memory`, `placement`, `adapter_activity` and `spilled` are the previous call's
    (empty at first); `draining` lists endpoints being shut down; `long_prompts` the long
    prompts in flight per endpoint id; `verdicts` the pods the Envoys' reports show
    stalled or failing (by endpoint id: the reason), which are out of rotation like a pod
    known to be down; `slowness` the pods slower per request than their peers (steps),
    whose claims beyond their peers' are not believed (capacity.py). Pure: the same
    inputs give the same output.
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
    capacities = relative_capacities(pool.endpoints, believed, settings, slowness)
    scores = _scores(pool, pods.fresh, capacities, memory, settings, tuning)
    activity: dict[str, float] = {}
    placed: dict[str, tuple[str, ...]] = {}
    if pool.adapters:
        activity = activity_of(pool.adapters, pods.healthy, signals, adapter_activity, tuning)
        placed = pool_placement(
            pool, pods.healthy, signals, scores, placement, activity, settings, tuning
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
    weighed = _weights(pool, scores, pods, spill, long_prompts, settings)
    top = max(weighed.values(), default=1.0) or 1.0
    states = []
    for endpoint in pool.endpoints:
        key = endpoint_id(endpoint)
        observed = signals.get(key)
        states.append(
            _endpoint_state(
                endpoint,
                weight=quantize(MAX_WEIGHT * weighed[key] / top, tuning.weight_ladder),
                ring_weight=quantize(
                    MAX_WEIGHT * capacities[key] ** settings.scorers.capacity,
                    tuning.weight_ladder,
                )
                if pool.session_affinity
                else None,
                adapters=placed[key]
                if key in placed
                else tuple(sorted(observed.adapters))
                if observed is not None
                else (),
                pods=pods,
                spilled=spill,
                long_prompts=long_prompts,
                reasons=_reasons(key, pods, spill, capacities, slowness, settings, tuning),
            )
        )
    return ScoredPool(
        state=PoolState(name=pool.name, endpoints=tuple(states)),
        memory=scores,
        placement=placed,
        adapter_activity=activity,
        spilled=spill.loaded,
    )
