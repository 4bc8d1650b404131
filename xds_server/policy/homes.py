"""Key homes balanced by load: the session cluster's ring weights, nudged by what pods carry.

Maglev hashes each session key to a slot of a table whose slots the pods share by their
ring weights (capacity alone, weights.py). With a few dozen keys, where the hash drops them
decides the load: on scenario c, 32 prefix groups got 11/9/9/3 homes on every seed, and one
pod served 19-49 requests while the others served 50-217. The server sees no key, but it
sees what each pod carries (running plus waiting, from its metrics, keyed traffic and
unkeyed alike) and how often it spills its keys (spill.py): over a window of decisions, a
pod whose share of the pool's load is beyond its share of the ring's capacity and which
spilled its keys in `Tuning.home_spill_share` of the window gets a smaller ring weight (its
factor divided by its ratio), so that Maglev hands some of its slots, and the keys in them,
to the others.

Only a pod that spills: a key that moves loses its cached prefix, and on scenario c, whose
pods have room, moving keys by load share alone (every pod's factor divided by its ratio,
each window) evened the requests per pod (68/66/59/45 against 87/71/63/17) and cost the
moved keys their prefixes: P95 TTFT 0.51 s against 0.14 s, seeds 1-2. A pod that spills
sends its keys' requests to pods without their prefixes anyway, request after request;
moving a few of its keys for good costs one miss each.

Moves are bounded: at most once per window (`home_window_intervals` busy decisions: one
where the pods hold under `home_min_load` each on average counts for nothing and leaves
the memory as it was), only beyond `home_tolerance`, and every factor stays within
`home_max_factor` of 1. A pod that joins or leaves restarts the window (its keys move
anyway). `home_max_factor` 1 keeps the hash's homes.

Server replicas each measure their own window, so for a window their Envoys can hash a
key to different pods (docs/routing.md says so).

Pure: the memory of the last call comes in, the next goes out; no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from xds_server.policy.reasons import Reason
from xds_server.policy.signals import PodSignals
from xds_server.tuning import Tuning

__all__ = ["HomeMemory", "Homes", "balanced_homes"]


@dataclass(frozen=True, kw_only=True)
class HomeMemory:
    """What the homes rule remembers of a pool: each pod's ring-weight factor (1 when
    absent), its load (running plus waiting) summed over the window's `samples`
    decisions and the number of them in which it spilled, and each factor's ratio of load
    share to capacity share when it was set."""

    factors: Mapping[str, float] = field(default_factory=dict)
    load: Mapping[str, float] = field(default_factory=dict)
    spills: Mapping[str, int] = field(default_factory=dict)
    samples: int = 0
    ratios: Mapping[str, float] = field(default_factory=dict)

    def factor(self, key: str) -> float:
        return self.factors.get(key, 1.0)


@dataclass(frozen=True, kw_only=True)
class Homes:
    memory: HomeMemory
    # Why a pod's ring weight is off its capacity's (pods whose factor is not 1).
    reasons: Mapping[str, Reason]


def balanced_homes(
    healthy: Sequence[str],
    fresh: Mapping[str, PodSignals],
    capacity_shares: Mapping[str, float],
    spilling: Set[str],
    memory: HomeMemory,
    tuning: Tuning,
) -> Homes:
    """The ring-weight factors of the pool's pods after this decision.

    `healthy`: the pods in rotation; `fresh`: their believed signals; `capacity_shares`:
    each pod's ring weight from capacity alone (any scale); `spilling`: the pods spilling
    their keys for load now; `memory`: the last call's.
    """
    present = tuple(k for k in healthy if k in fresh and capacity_shares.get(k, 0.0) > 0)
    now = sum(fresh[k].running + fresh[k].waiting for k in present)
    if not present or now < tuning.home_min_load * len(present):
        # An idle decision teaches nothing, and leaves the memory as it was: an idle pool's
        # decision stays the same, and costs nothing (decision.py's Decider).
        return Homes(memory=memory, reasons=_reasons(memory.factors, memory.ratios, present))
    factors = {k: f for k, f in memory.factors.items() if k in present}
    ratios = {k: r for k, r in memory.ratios.items() if k in factors}
    load, spills, samples = dict(memory.load), dict(memory.spills), memory.samples
    if set(load) != set(present):
        load, spills, samples = dict.fromkeys(present, 0.0), dict.fromkeys(present, 0), 0
    for key in present:
        load[key] += fresh[key].running + fresh[key].waiting
        spills[key] += key in spilling
    samples += 1
    if samples >= tuning.home_window_intervals:
        moved = _rebalanced(present, load, spills, samples, capacity_shares, factors, tuning)
        if moved is not None:
            factors, moved_ratios = moved
            ratios = {k: r for k, r in ratios.items() if k in factors} | moved_ratios
        load, spills, samples = dict.fromkeys(present, 0.0), dict.fromkeys(present, 0), 0
    kept = HomeMemory(factors=factors, load=load, spills=spills, samples=samples, ratios=ratios)
    return Homes(memory=kept, reasons=_reasons(factors, ratios, present))


def _rebalanced(
    present: Sequence[str],
    load: Mapping[str, float],
    spills: Mapping[str, int],
    samples: int,
    capacity_shares: Mapping[str, float],
    factors: Mapping[str, float],
    tuning: Tuning,
) -> tuple[dict[str, float], dict[str, float]] | None:
    """New factors, and the ratios of the pods that moved, when the window shows a busy
    pool with a pod beyond its share by more than the tolerance that spilled in enough of
    it; None otherwise."""
    total = sum(load[k] for k in present)
    if len(present) < 2 or total < tuning.home_min_load * len(present) * samples:
        return None
    capacity = sum(capacity_shares[k] for k in present)
    ratios = {k: (load[k] / total) / (capacity_shares[k] / capacity) for k in present}
    movers = [
        k
        for k in present
        if ratios[k] > 1 + tuning.home_tolerance
        and spills[k] >= tuning.home_spill_share * samples
        and factors.get(k, 1.0) > 1 / tuning.home_max_factor
    ]
    if not movers:
        return None
    moved = dict(factors)
    for key in movers:
        moved[key] = max(1 / tuning.home_max_factor, moved.get(key, 1.0) / ratios[key])
    kept = {k: f for k, f in moved.items() if f != 1.0}
    return kept, {k: ratios[k] for k in movers}


def _reasons(
    factors: Mapping[str, float], ratios: Mapping[str, float], present: Sequence[str]
) -> dict[str, Reason]:
    reasons = {}
    for key, factor in factors.items():
        if key in present:
            ratio = ratios.get(key)
            seen = f" (load {ratio:.2f}x its capacity share at the move)" if ratio else ""
            detail = f"ring weight x{factor:.2f}: it kept spilling{seen}"
            reasons[key] = Reason("home_share", detail)
    return reasons
