"""Each Envoy's part of a band's budget, following its demand (pure: no I/O).

A band's budget B (admission.py) bounds the requests of the band in flight over every
Envoy of the fleet, and each Envoy's circuit breaker enforces its own part. Splitting B
evenly (B / N) refuses requests at an Envoy whose clients are busy while another sits on
places it does not use; so each Envoy's *target* follows its recent demand (its requests in
flight, plus what it sent or refused over the horizon), after a floor every Envoy keeps so
that one whose traffic starts can start at once; places that no demand asks for are
shared evenly (a pool with room to spare refuses nobody for being quiet a moment ago).

Targets alone would over-admit: an admitted request cannot be taken back, so an Envoy
whose target shrinks below what it holds keeps holding it until those requests finish,
while the Envoy whose target grew admits at once. So the limit an Envoy gets is:

- above its target (holds more than its part): its target, so it admits nothing until it
  drains below it;
- below its target: what it holds, plus its part of the free places (B minus everything
  held) in proportion to how far below its target it is.

Over the Envoys, what they may hold then sums to B, plus the floor of an Envoy the pool is
too full for (at most one request each with the default floor of 1). Every split is by
largest remainder with ties broken by node id: the same inputs give the same limits on
every server replica.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["EnvoyDemand", "apportion", "held_limits", "split_budget"]


@dataclass(frozen=True, kw_only=True)
class EnvoyDemand:
    """One Envoy's recent use of one band (its load reports)."""

    # Requests of the band in flight at this Envoy.
    in_flight: int = 0
    # Requests of the band it sent upstream or refused (overflow), per second.
    arrivals_per_s: float = 0.0


def apportion(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """`total` split into integers in proportion to `weights` (largest remainder; equal
    parts when every weight is 0). The parts sum to `total`; ties go to the smaller key."""
    if not weights:
        return {}
    total = max(0, total)
    positive = {key: max(0.0, w) if math.isfinite(w) else 0.0 for key, w in weights.items()}
    weight_sum = sum(positive.values())
    if weight_sum <= 0:
        positive = dict.fromkeys(weights, 1.0)
        weight_sum = float(len(weights))
    quotas = {key: total * w / weight_sum for key, w in positive.items()}
    parts = {key: math.floor(q) for key, q in quotas.items()}
    left = total - sum(parts.values())
    by_remainder = sorted(quotas, key=lambda key: (parts[key] - quotas[key], key))
    for key in by_remainder[:left]:
        parts[key] += 1
    return parts


def split_budget(
    budget: int,
    envoys: Mapping[str, EnvoyDemand],
    *,
    floor: int,
    horizon_s: float,
) -> dict[str, int]:
    """Each of `envoys`' limit (by node id) for a band whose fleet-wide budget is `budget`
    (module docstring). `floor` places go to every Envoy first while the budget has that
    many for each; `horizon_s` weighs arrivals against requests in flight."""
    if not envoys:
        return {}
    budget = max(0, budget)
    base = min(floor, budget // len(envoys))
    if not any(d.in_flight or d.arrivals_per_s > 0 for d in envoys.values()):
        return _split_idle(budget, envoys, base=base)
    return _split(budget, envoys, base=base, horizon_s=horizon_s)


def _split_idle(budget: int, envoys: Mapping[str, EnvoyDemand], *, base: int) -> dict[str, int]:
    """`split_budget` when no Envoy holds or asks for anything (most Envoys of most pools,
    at fleet size): each gets the same part, the remainder one each in node id order.
    The same result as `_split`'s, in a fraction of its time."""
    share, left = divmod(budget - base * len(envoys), len(envoys))
    limits = dict.fromkeys(envoys, base + share)
    for node in sorted(envoys)[:left]:
        limits[node] += 1
    return limits


def _split(
    budget: int, envoys: Mapping[str, EnvoyDemand], *, base: int, horizon_s: float
) -> dict[str, int]:
    """`split_budget`, in general."""
    demand = {
        node: d.in_flight + max(0.0, d.arrivals_per_s) * horizon_s for node, d in envoys.items()
    }
    rest = budget - base * len(envoys)
    # Places no demand asks for are shared evenly: an Envoy whose traffic is about to
    # grow finds room, and only a budget that demand exceeds is split by demand alone.
    slack = max(0.0, rest - sum(demand.values())) / len(envoys)
    weights = {node: d + slack for node, d in demand.items()}
    targets = {node: base + part for node, part in apportion(rest, weights).items()}
    held = {node: d.in_flight for node, d in envoys.items()}
    return held_limits(budget, targets, held, base=base)


def held_limits(
    budget: int, targets: Mapping[str, int], held: Mapping[str, int], *, base: int
) -> dict[str, int]:
    """The limits of parts of `budget` whose `targets` moved while each part holds `held`
    (module docstring): a part above its target is held at it; a part below gets what it
    holds plus the free places (the budget less all held) in proportion to how far below
    its target it is; at least `base` each."""
    held = {key: max(0, held.get(key, 0)) for key in targets}
    free = budget - sum(held.values())
    deficits = {key: targets[key] - held[key] for key in targets if held[key] < targets[key]}
    limits = {key: min(targets[key], held[key]) for key in targets}
    if free > 0 and deficits:
        for key, extra in apportion(free, deficits).items():
            limits[key] = held[key] + min(extra, deficits[key])
    return {key: max(limit, base) for key, limit in limits.items()}
