"""Tenants' fair shares of a band: by weight under contention, lent when idle, taken back
without over-admitting."""

from __future__ import annotations

import random

from xds_server.policy.tenant_shares import SHARED_LANE, LaneDemand, fair_targets, split_band

BUSY = 100.0  # requests per second: far more than any budget here


def _lanes(**wants: tuple[float, int, float]) -> dict[str, LaneDemand]:
    """Lanes by name: (weight, in flight, arrivals per second)."""
    return {
        name: LaneDemand(weight=w, in_flight=held, arrivals_per_s=rate)
        for name, (w, held, rate) in wants.items()
    }


def test_under_contention_each_busy_tenant_gets_its_weighted_share() -> None:
    """Weights 1, 2, 3, all busy, the shared lane idle: it keeps its floor (one place per
    Envoy, 2), and the rest goes 1:2:3, the floor inside each share, not on top of it."""
    lanes = _lanes(a=(1, 0, BUSY), b=(2, 0, BUSY), c=(3, 0, BUSY))
    lanes[SHARED_LANE] = LaneDemand(weight=1)
    limits = split_band(26, lanes, floor=2, horizon_s=0.5)
    assert limits == {"a": 4, "b": 8, "c": 12, SHARED_LANE: 2}


def test_an_idle_tenants_share_is_lent_and_taken_back_as_the_borrowers_drain() -> None:
    shared = {SHARED_LANE: LaneDemand(weight=1)}
    # c idle: it keeps its floor, a and b split the rest 1:2.
    idle_c = _lanes(a=(1, 0, BUSY), b=(2, 0, BUSY), c=(3, 0, 0))
    lent = split_band(26, {**idle_c, **shared}, floor=2, horizon_s=0.5)
    assert lent == {"a": 7, "b": 15, "c": 2, SHARED_LANE: 2}
    # c comes back while a and b hold what they borrowed: they are held at their shares,
    # and c gets only its part of the 4 places free (the shared lane's deficit has the
    # rest) until they drain.
    back = _lanes(a=(1, 7, BUSY), b=(2, 15, BUSY), c=(3, 0, BUSY))
    returning = split_band(26, {**back, **shared}, floor=2, horizon_s=0.5)
    assert returning == {"a": 4, "b": 8, "c": 3, SHARED_LANE: 2}
    # Drained to their shares: c has its own back.
    drained = _lanes(a=(1, 4, BUSY), b=(2, 8, BUSY), c=(3, 2, BUSY))
    assert split_band(26, {**drained, **shared}, floor=2, horizon_s=0.5) == {
        "a": 4,
        "b": 8,
        "c": 12,
        SHARED_LANE: 2,
    }


def test_a_tenant_that_wants_little_leaves_the_rest_to_the_others_by_weight() -> None:
    targets = fair_targets(
        30, _lanes(a=(1, 0, BUSY), b=(2, 0, BUSY), c=(3, 3, 0)), base=1, horizon_s=0.5
    )
    assert targets == {"a": 9, "b": 18, "c": 3}


def test_room_to_spare_goes_to_every_lane_by_weight() -> None:
    targets = fair_targets(60, _lanes(a=(1, 2, 0), b=(2, 0, 0), c=(3, 0, 0)), base=1, horizon_s=0.5)
    assert sum(targets.values()) == 60
    assert targets["b"] < targets["c"] and targets["a"] >= 2


def test_a_budget_smaller_than_the_floors_is_split_by_weight_and_want() -> None:
    assert split_band(0, _lanes(a=(1, 0, BUSY), b=(2, 0, 0)), floor=2, horizon_s=0.5) == {
        "a": 0,
        "b": 0,
    }
    scarce = split_band(3, _lanes(a=(1, 0, BUSY), b=(2, 0, 0)), floor=2, horizon_s=0.5)
    assert scarce == {"a": 2, "b": 1}


def test_random_bands_hold_the_budget_and_the_weights() -> None:
    """Random bands: the targets sum to the budget, each at least the floor that fits; a
    lane that wants at least its weighted share gets no less than it, give or take a
    place; what the lanes may hold sums to at most the budget (or what they hold) plus one
    floor per lane; and the split does not depend on the order of the lanes."""
    rng = random.Random(11)
    for _ in range(2000):
        budget = rng.randrange(0, 80)
        lanes = {
            f"t{i}": LaneDemand(
                weight=rng.choice((0.5, 1, 2, 3, 7.5)),
                in_flight=rng.randrange(0, 15),
                arrivals_per_s=rng.random() * 40 if rng.random() < 0.7 else 0.0,
            )
            for i in range(rng.randrange(1, 7))
        }
        floor = rng.randrange(0, 4)
        base = min(floor, budget // len(lanes))
        targets = fair_targets(budget, lanes, base=base, horizon_s=0.5)
        assert sum(targets.values()) == budget
        assert min(targets.values()) >= base
        total = sum(d.weight for d in lanes.values())
        for name, d in lanes.items():
            want = d.in_flight + d.arrivals_per_s * 0.5
            share = (budget - base * len(lanes)) * d.weight / total
            if want >= share:
                assert targets[name] >= share - 1, (name, targets, lanes)
        limits = split_band(budget, lanes, floor=floor, horizon_s=0.5)
        exposure = sum(max(limits[n], d.in_flight) for n, d in lanes.items())
        held = sum(d.in_flight for d in lanes.values())
        assert exposure <= max(held, budget) + base * len(lanes)
        assert (
            split_band(budget, dict(reversed(lanes.items())), floor=floor, horizon_s=0.5) == limits
        )
