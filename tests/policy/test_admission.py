"""Flow-control admission: per-band limits and Retry-After from capacity and load."""

from __future__ import annotations

from xds_server.config import FlowControlConfig
from xds_server.policy.admission import (
    UNLIMITED,
    BandLoad,
    PodCapacity,
    PodsHeld,
    admit,
    plausible_load,
    pod_capacity,
)
from xds_server.policy.shares import EnvoyDemand

# How long limits stand: two scrape intervals of the default 0.25 s.
HORIZON_S = 0.5
SETTINGS = FlowControlConfig(
    enabled=True,
    pod_concurrency={"h100": 32, "a10g": 4},
    default_pod_concurrency=8,
    critical_headroom=0,
    sheddable_utilization=1,
)


def idle(hardware: str | None = "h100") -> PodCapacity:
    return PodCapacity(hardware=hardware, running=0, waiting=0, kv_usage=0.1)


def load(critical: int = 0, standard: int = 0, sheddable: int = 0, rate: float = 10.0) -> BandLoad:
    return BandLoad(
        in_flight={"critical": critical, "standard": standard, "sheddable": sheddable},
        completions_per_s=rate,
    )


def test_pod_capacity_by_hardware_and_when_full() -> None:
    assert pod_capacity(idle("h100"), settings=SETTINGS) == 32
    assert pod_capacity(idle("a10g"), settings=SETTINGS) == 4
    assert pod_capacity(idle(None), settings=SETTINGS) == 8
    # Waiting requests or a full KV cache: the pod is full at what it runs.
    queued = PodCapacity(hardware="h100", running=20, waiting=3)
    assert pod_capacity(queued, settings=SETTINGS) == 20
    preempting = PodCapacity(hardware="h100", running=12, waiting=0, kv_usage=0.97)
    assert pod_capacity(preempting, settings=SETTINGS) == 12


def test_strict_priority_budgets() -> None:
    pods = [idle(), idle()]  # capacity 64
    quiet = admit(pods, load=load(), settings=SETTINGS, horizon_s=HORIZON_S)
    assert quiet.capacity == 64
    assert quiet.budget == {"critical": UNLIMITED, "standard": 64, "sheddable": 64}

    busy = admit(
        pods,
        load=load(critical=20, standard=30, sheddable=10),
        settings=SETTINGS,
        horizon_s=HORIZON_S,
    )
    # Standard gets what Critical and (running) Sheddable leave; Sheddable only the spare.
    assert busy.budget == {"critical": UNLIMITED, "standard": 34, "sheddable": 14}
    assert sum(busy.in_flight.values()) == 60

    flooded = admit(pods, load=load(critical=70), settings=SETTINGS, horizon_s=HORIZON_S)
    assert flooded.budget == {"critical": UNLIMITED, "standard": 0, "sheddable": 0}


def test_each_envoy_gets_its_part_and_together_they_stay_within_the_budget() -> None:
    pods = [idle(), idle(), idle("a10g")]  # capacity 68
    for count in (1, 2, 3, 7):
        demand = {
            f"envoy-{i}": {"standard": EnvoyDemand(in_flight=i, arrivals_per_s=float(i))}
            for i in range(count)
        }
        shared = admit(
            pods,
            load=BandLoad(
                in_flight={"critical": 5, "standard": sum(range(count)), "sheddable": 0},
                by_envoy=demand,
            ),
            settings=SETTINGS,
            horizon_s=HORIZON_S,
        )
        assert shared.budget["standard"] == 68 - 5
        limits = [shared.limits_of(node)["standard"] for node in demand]
        assert sum(limits) == 68 - 5
        # Busier Envoys get more, and every one its floor.
        assert limits == sorted(limits) and min(limits) >= SETTINGS.envoy_floor
        # An Envoy the decision does not name yet gets the floor.
        assert shared.limits_of("new")["standard"] == SETTINGS.envoy_floor


def test_a_budget_held_back_for_unseen_replicas_is_not_split() -> None:
    demand = {"a": {"standard": EnvoyDemand(arrivals_per_s=5.0)}}
    shared = admit(
        [idle()],
        load=BandLoad(in_flight={}, by_envoy=demand),
        settings=SETTINGS,
        reserved=0.5,
        horizon_s=HORIZON_S,
    )
    assert shared.budget["standard"] == 32
    assert shared.limits_of("a")["standard"] == 16


def test_no_ready_pod_means_no_capacity_but_critical_stays_unlimited() -> None:
    admission = admit([], load=load(critical=1), settings=SETTINGS, horizon_s=HORIZON_S)
    assert admission.capacity == 0
    assert admission.budget == {"critical": UNLIMITED, "standard": 0, "sheddable": 0}
    assert admission.retry_after_s["sheddable"] == SETTINGS.retry_after_max_s


def test_retry_after_follows_the_expected_drain_time() -> None:
    pods = [idle()]  # capacity 32
    light = admit(pods, load=load(standard=10, rate=8.0), settings=SETTINGS, horizon_s=HORIZON_S)
    assert light.retry_after_s["sheddable"] == 1  # a place is free now: the minimum
    heavy = admit(
        pods, load=load(critical=10, standard=60, rate=4.0), settings=SETTINGS, horizon_s=HORIZON_S
    )
    # 70 in flight for 32 places: 39 must finish first at 4/s, about 10 s (ladder: 10).
    assert heavy.retry_after_s["sheddable"] == 10
    assert heavy.retry_after_s["standard"] == 10
    slower = admit(
        pods, load=load(critical=10, standard=60, rate=1.0), settings=SETTINGS, horizon_s=HORIZON_S
    )
    assert slower.retry_after_s["sheddable"] == 40
    capped = admit(pods, load=load(standard=500, rate=1.0), settings=SETTINGS, horizon_s=HORIZON_S)
    assert capped.retry_after_s["sheddable"] == SETTINGS.retry_after_max_s


def test_headroom_keeps_places_free_for_critical() -> None:
    settings = SETTINGS.model_copy(update={"critical_headroom": 0.25})
    admission = admit(
        [idle(), idle()], load=load(critical=4), settings=settings, horizon_s=HORIZON_S
    )
    # 64 places, 16 kept for Critical: Standard may take 64 - 16 - 4.
    assert admission.budget["standard"] == 44
    assert admission.budget["sheddable"] == 44
    assert admission.budget["critical"] == UNLIMITED


def test_sheddable_leaves_what_standard_will_take_before_the_next_update() -> None:
    arriving = BandLoad(
        in_flight={"critical": 0, "standard": 20, "sheddable": 0},
        completions_per_s=5.0,
        issued_per_s={"standard": 40.0},
    )
    admission = admit([idle(), idle()], load=arriving, settings=SETTINGS, horizon_s=0.25)
    # 44 free places; Standard is expected to take 40/s x 0.25 s = 10 of them.
    assert admission.budget["standard"] == 64
    assert admission.budget["sheddable"] == 34


def test_sheddable_stops_before_the_pool_is_full() -> None:
    settings = SETTINGS.model_copy(update={"sheddable_utilization": 0.75})
    admission = admit(
        [idle(), idle()], load=load(standard=40), settings=settings, horizon_s=HORIZON_S
    )
    # 64 places: Standard may fill them all, Sheddable only up to 48 in all.
    assert admission.budget["standard"] == 64
    assert admission.budget["sheddable"] == 8


def test_an_envoys_part_is_split_over_the_bands_lanes() -> None:
    """Each lane (its own cluster and circuit breaker) gets a part of the Envoy's band
    limit, so that together they admit the limit, not that many times it."""
    lanes = {
        "pool": EnvoyDemand(in_flight=6, arrivals_per_s=2.0),
        "session": EnvoyDemand(in_flight=2),
        "long": EnvoyDemand(),
    }
    load = BandLoad(
        in_flight={"standard": 8},
        by_envoy={"a": {"standard": EnvoyDemand(in_flight=8, arrivals_per_s=2.0)}},
        lanes_by_envoy={"a": {"standard": lanes}},
    )
    admission = admit([idle()], load=load, settings=SETTINGS, horizon_s=HORIZON_S)  # capacity 32
    limit = admission.limits_of("a")["standard"]
    parts = {lane: admission.lane_limit("a", "standard", lane) for lane in lanes}
    assert sum(parts.values()) == limit == 32
    # Every lane may start one, and none is cut below what it holds.
    assert parts["long"] >= 1 and parts["pool"] >= 6 and parts["session"] >= 2
    # An Envoy not named yet: the floor in every lane.
    assert admission.lane_limit(None, "standard", "session") == SETTINGS.envoy_floor


def _fleet(critical: dict[str, int], standard: dict[str, int]) -> BandLoad:
    """Envoys' reports: each its Critical and Standard requests in flight (arriving at
    one per second per request)."""
    by_envoy = {
        node: {
            "critical": EnvoyDemand(in_flight=critical[node], arrivals_per_s=critical[node]),
            "standard": EnvoyDemand(in_flight=standard[node], arrivals_per_s=standard[node]),
        }
        for node in critical
    }
    return BandLoad(
        in_flight={
            "critical": sum(critical.values()),
            "standard": sum(standard.values()),
            "sheddable": 0,
        },
        completions_per_s=10.0,
        by_envoy=by_envoy,
    )


def test_one_envoys_inflated_report_leaves_every_other_envoys_limits_unchanged() -> None:
    pods = [PodCapacity(hardware="h100", running=10, waiting=0) for _ in range(4)]
    held = PodsHeld(requests=40, pods=4)  # capacity 128; the pods run 40
    honest = {"a": 6, "b": 6, "c": 8, "liar": 0}
    standard = {"a": 5, "b": 5, "c": 10, "liar": 0}
    truth = admit(
        pods, load=_fleet(honest, standard), settings=SETTINGS, held=held, horizon_s=HORIZON_S
    )
    lie = admit(
        pods,
        load=_fleet({**honest, "liar": 1000}, standard),
        settings=SETTINGS,
        held=held,
        horizon_s=HORIZON_S,
    )
    assert truth.clipped == {}
    assert lie.clipped == {"liar": 1000}
    assert lie.budget == truth.budget
    assert lie.in_flight == truth.in_flight
    for node in ("a", "b", "c"):
        assert lie.limits_of(node) == truth.limits_of(node)
    # Without the check the lie would have taken the Standard budget to nothing.
    unchecked = admit(
        pods,
        load=_fleet({**honest, "liar": 1000}, standard),
        settings=SETTINGS,
        horizon_s=HORIZON_S,
    )
    assert unchecked.budget["standard"] == 0 < truth.budget["standard"]


def test_a_liar_keeps_what_the_pods_hold_beyond_the_others_and_its_bands_scale_alike() -> None:
    held = PodsHeld(requests=50, pods=4)
    load = _fleet({"a": 10, "liar": 200}, {"a": 20, "liar": 200})
    believed, clipped = plausible_load(load, held)
    # The pods hold 50; the others say 30: the liar is believed for 20, half each band.
    assert clipped == {"liar": 380}
    liar = believed.by_envoy["liar"]
    assert (liar["critical"].in_flight, liar["standard"].in_flight) == (10, 10)
    assert liar["standard"].arrivals_per_s == 200 * 20 / 400
    assert believed.in_flight == {"critical": 20, "standard": 30, "sheddable": 0}
    assert believed.by_envoy["a"] is load.by_envoy["a"]


def test_reports_a_little_ahead_of_the_pods_metrics_are_believed() -> None:
    # The pods' pages lag (scraped a quarter second ago) and requests are in transit:
    # the reports may say a quarter more, and two per pod.
    held = PodsHeld(requests=40, pods=4)
    load = _fleet({"a": 20, "b": 20}, {"a": 4, "b": 14})
    believed, clipped = plausible_load(load, held)
    assert clipped == {} and believed is load


def test_two_liars_are_both_taken_down() -> None:
    held = PodsHeld(requests=20, pods=2)
    load = _fleet({"a": 10, "b": 10, "x": 500, "y": 400}, dict.fromkeys("abxy", 0))
    _, clipped = plausible_load(load, held)
    assert clipped == {"x": 500, "y": 400}


def test_a_liars_tenant_lanes_are_scaled_with_its_bands() -> None:
    """A weighted tenant's lane is the Envoy's report too: counted against what the pods
    hold, and scaled alike when not believed."""
    held = PodsHeld(requests=20, pods=1)
    load = BandLoad(
        in_flight={"critical": 0, "standard": 410},
        by_envoy={
            "a": {"standard": EnvoyDemand(in_flight=10)},
            "liar": {"standard": EnvoyDemand(in_flight=200)},
        },
        tenants_by_envoy={"liar": {"standard": {"t": EnvoyDemand(in_flight=200)}}},
    )
    believed, clipped = plausible_load(load, held)
    # The pods hold 20; a says 10: the liar is believed for 10 of its 400, half per lane.
    assert clipped == {"liar": 390}
    assert believed.by_envoy["liar"]["standard"].in_flight == 5
    assert believed.tenants_by_envoy["liar"]["standard"]["t"].in_flight == 5
    assert believed.in_flight["standard"] == 20
