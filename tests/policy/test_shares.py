"""Each Envoy's part of a band's budget: follows demand, keeps a floor, never over-admits."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from xds_server.policy import shares
from xds_server.policy.shares import EnvoyDemand, apportion, split_budget


def test_apportion_sums_to_the_total_and_breaks_ties_by_key() -> None:
    assert apportion(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    assert apportion(7, {"a": 0, "b": 0}) == {"a": 4, "b": 3}
    assert apportion(5, {"a": 3, "b": 1, "c": float("nan")}) == {"a": 4, "b": 1, "c": 0}
    assert apportion(0, {"a": 1}) == {"a": 0}
    assert apportion(3, {}) == {}


def test_all_traffic_through_one_envoy_gets_the_budget_but_the_others_floor() -> None:
    limits = split_budget(
        12,
        {"busy": EnvoyDemand(in_flight=4, arrivals_per_s=20.0), "idle": EnvoyDemand()},
        floor=1,
        horizon_s=1.0,
    )
    assert limits == {"busy": 11, "idle": 1}


def test_places_no_demand_asks_for_are_shared_evenly() -> None:
    """A pool with room to spare: the quiet Envoy gets half of what nobody asks for, not
    only its floor, so its next requests are not refused."""
    limits = split_budget(
        20,
        {"busy": EnvoyDemand(in_flight=2), "quiet": EnvoyDemand()},
        floor=1,
        horizon_s=1.0,
    )
    assert limits == {"busy": 11, "quiet": 9}


def test_an_envoy_over_its_target_drains_before_the_others_lose_their_places() -> None:
    # "old" holds the whole budget; "new" now has all the demand. Nothing held is taken
    # back: "old" may start nothing until it drains to its target (its floor) ...
    limits = split_budget(
        8,
        {"old": EnvoyDemand(in_flight=8), "new": EnvoyDemand(arrivals_per_s=50.0)},
        floor=1,
        horizon_s=1.0,
    )
    target_old = limits["old"]
    assert target_old < 8
    # ... and "new" gets only its floor meanwhile (no free place), so at most 8 + 1 run.
    assert limits["new"] == 1
    # Once "old" has drained half, "new" gets the places freed.
    later = split_budget(
        8,
        {"old": EnvoyDemand(in_flight=4), "new": EnvoyDemand(in_flight=1, arrivals_per_s=50.0)},
        floor=1,
        horizon_s=1.0,
    )
    assert later["new"] == 8 - 4
    assert later["old"] <= 4


def test_no_budget_means_no_floor() -> None:
    limits = split_budget(
        0, {"a": EnvoyDemand(arrivals_per_s=9.0), "b": EnvoyDemand()}, floor=1, horizon_s=1.0
    )
    assert limits == {"a": 0, "b": 0}
    # Fewer places than Envoys: no floor, the places go by demand.
    scarce = split_budget(
        2,
        {"a": EnvoyDemand(arrivals_per_s=9.0), "b": EnvoyDemand(), "c": EnvoyDemand()},
        floor=1,
        horizon_s=1.0,
    )
    assert scarce == {"a": 2, "b": 0, "c": 0}


def test_what_envoys_may_hold_stays_within_the_budget_plus_their_floors() -> None:
    """Random fleets: the most each Envoy may have in flight under its new limit (what it
    holds, if more) sums to at most the budget plus one floor per Envoy; and the split does
    not depend on the order the Envoys come in."""
    rng = random.Random(7)
    for _ in range(2000):
        budget = rng.randrange(0, 40)
        envoys = {
            f"e{i}": EnvoyDemand(in_flight=rng.randrange(0, 12), arrivals_per_s=rng.random() * 20)
            for i in range(rng.randrange(1, 6))
        }
        floor = rng.randrange(0, 3)
        limits = split_budget(budget, envoys, floor=floor, horizon_s=0.5)
        assert limits.keys() == envoys.keys()
        exposure = sum(max(limits[n], d.in_flight) for n, d in envoys.items())
        held = sum(d.in_flight for d in envoys.values())
        # Over budget already (the budget shrank), only the floors add to what is held.
        assert exposure <= max(held, budget) + floor * len(envoys)
        assert (
            split_budget(budget, dict(reversed(envoys.items())), floor=floor, horizon_s=0.5)
            == limits
        )


@given(
    budget=st.integers(min_value=0, max_value=5_000),
    envoys=st.integers(min_value=1, max_value=600),
    floor=st.integers(min_value=0, max_value=4),
)
def test_the_split_of_idle_envoys_is_the_general_one(budget: int, envoys: int, floor: int) -> None:
    """At fleet size most Envoys of most pools ask for nothing; their split takes a short
    way that must give exactly what the general one gives."""
    idle = {f"envoy-{i:03d}": EnvoyDemand() for i in range(envoys)}
    base = min(floor, budget // envoys)
    assert split_budget(budget, idle, floor=floor, horizon_s=0.5) == shares._split(
        budget, idle, base=base, horizon_s=0.5
    )
