"""Each tenant's fair share of a band's budget, by weight (pure: no I/O).

With weighted tenants (`flow_control.tenants.named.<tenant>.weight`), a band's budget B
(admission.py) is split over lanes: one per weighted tenant, and the band's shared lane
for every other request (SHARED_LANE, weight 1). Each lane's part is enforced by its own
clusters' circuit breakers, each Envoy holding a part of it that follows its demand
(shares.py).

**Targets: weighted max-min fairness.** A lane's want is its requests in flight plus what
it sent or refused over the horizon. The budget is water-filled by weight: every lane gets
`level × weight`, but no more than it wants and no less than the floor, with the level set
so that the targets sum to B. A lane that wants less than its weighted share leaves the rest
to the others in proportion to their weights (borrowing); when every want is met, what is
left is shared by weight over all lanes (a pool with room to spare refuses nobody for
having been quiet). The floor, `floor` places per lane while the budget has that many for
each, lets an idle lane's first requests start at once (the caller gives one place per
Envoy, so each Envoy holds one); it is part of the lane's weighted share, not added to it,
so busy lanes' shares stay in proportion to their weights.

**Limits: held at the target.** An admitted request cannot be taken back, so a lane above
its new target (it borrowed, and the lender came back) is held at it and admits nothing
until it drains below; the places freed go to the lanes below their targets (shares.py's
held_limits). A returning lane therefore gets its share back within one decision interval
plus the time the borrowers' extra requests take to finish. What the lanes may hold sums
to B, plus a floor per lane when the pool is too full for it.

Every split is by largest remainder with ties broken by name: the same inputs give the same
parts on every server replica.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from xds_server.policy.shares import apportion, held_limits

__all__ = ["LaneDemand", "SHARED_LANE", "fair_targets", "split_band"]

# The key of a band's shared lane (no tenant name can be `*`: config.TenantsConfig).
SHARED_LANE = "*"


@dataclass(frozen=True, kw_only=True)
class LaneDemand:
    """One lane of a band over the fleet: its weight and its recent use (load reports)."""

    weight: float
    # Requests of the lane in flight over every Envoy.
    in_flight: int = 0
    # Requests of the lane sent upstream or refused (overflow), per second, over every Envoy.
    arrivals_per_s: float = 0.0


def split_band(
    budget: int, lanes: Mapping[str, LaneDemand], *, floor: int, horizon_s: float
) -> dict[str, int]:
    """Each lane's limit over the fleet (module docstring): its target, or, while it holds
    more, what it holds now less nothing (it is held), or below its target what it holds
    plus its part of the free places."""
    if not lanes:
        return {}
    budget = max(0, budget)
    base = min(max(0, floor), budget // len(lanes))
    targets = fair_targets(budget, lanes, base=base, horizon_s=horizon_s)
    held = {lane: d.in_flight for lane, d in lanes.items()}
    return held_limits(budget, targets, held, base=base)


def fair_targets(
    budget: int, lanes: Mapping[str, LaneDemand], *, base: int, horizon_s: float
) -> dict[str, int]:
    """The weighted max-min fair targets of `lanes` (module docstring), in whole places
    summing to `budget`, each at least `base` (which must fit: base × lanes <= budget)."""
    # Sums in name order: the same floats, so the same rounding, whatever order they came.
    lanes = dict(sorted(lanes.items()))
    weights = {
        lane: d.weight if d.weight > 0 and math.isfinite(d.weight) else 1.0
        for lane, d in lanes.items()
    }
    wants = {
        lane: max(0.0, d.in_flight + max(0.0, d.arrivals_per_s) * max(0.0, horizon_s))
        for lane, d in lanes.items()
    }
    low = dict.fromkeys(lanes, float(base))
    high = {lane: max(float(base), want) for lane, want in wants.items()}
    if sum(high.values()) <= budget:
        # Every want is met: what is left goes to every lane by weight.
        left = budget - sum(high.values())
        total = sum(weights.values())
        quotas = {lane: high[lane] + left * weights[lane] / total for lane in lanes}
    else:
        level = _level(budget, weights, low, high)
        quotas = {lane: min(max(level * weights[lane], low[lane]), high[lane]) for lane in lanes}
    return {lane: max(base, part) for lane, part in apportion(budget, quotas).items()}


def _level(
    budget: float, weights: Mapping[str, float], low: Mapping[str, float], high: Mapping[str, float]
) -> float:
    """The water level λ at which Σ clamp(λ × weight, low, high) is `budget` (which lies
    between Σ low and Σ high): the sum is piecewise linear in λ, so the segment holding
    `budget` is found among the breakpoints and solved exactly."""

    def filled(level: float) -> float:
        return sum(min(max(level * weights[k], low[k]), high[k]) for k in weights)

    points = sorted(
        {low[k] / weights[k] for k in weights} | {high[k] / weights[k] for k in weights}
    )
    previous = 0.0
    for point in points:
        if filled(point) >= budget:
            slope = sum(
                weights[k]
                for k in weights
                if low[k] / weights[k] <= previous and high[k] / weights[k] >= point
            )
            if slope <= 0:
                return point
            return previous + (budget - filled(previous)) / slope
        previous = point
    return previous
