"""Flow-control admission: per-band limits and Retry-After from capacity and load."""

from __future__ import annotations

from xds_server.config import FlowControlConfig
from xds_server.policy.admission import UNLIMITED, BandLoad, PodCapacity, admit, pod_capacity

SETTINGS = FlowControlConfig(
    enabled=True, pod_concurrency={"h100": 32, "a10g": 4}, default_pod_concurrency=8
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
    quiet = admit(pods, load=load(), envoys=1, settings=SETTINGS)
    assert quiet.capacity == 64
    assert quiet.max_requests == {"critical": UNLIMITED, "standard": 64, "sheddable": 64}

    busy = admit(
        pods, load=load(critical=20, standard=30, sheddable=10), envoys=1, settings=SETTINGS
    )
    # Standard gets what Critical does not use; Sheddable only what is spare.
    assert busy.max_requests == {"critical": UNLIMITED, "standard": 44, "sheddable": 14}
    assert sum(busy.in_flight.values()) == 60 and busy.saturation == 60 / 64

    flooded = admit(pods, load=load(critical=70), envoys=1, settings=SETTINGS)
    assert flooded.max_requests == {"critical": UNLIMITED, "standard": 0, "sheddable": 0}


def test_budgets_are_shared_among_envoys_within_one_request_each() -> None:
    pods = [idle(), idle(), idle("a10g")]  # capacity 68
    for envoys in (1, 2, 3, 7):
        shared = admit(pods, load=load(critical=5, standard=20), envoys=envoys, settings=SETTINGS)
        for band, budget in (("standard", 68 - 5), ("sheddable", 68 - 25)):
            total = shared.max_requests[band] * envoys  # type: ignore[index]
            assert budget <= total <= budget + envoys


def test_no_ready_pod_means_no_capacity_but_critical_stays_unlimited() -> None:
    admission = admit([], load=load(critical=1), envoys=2, settings=SETTINGS)
    assert admission.capacity == 0
    assert admission.max_requests == {"critical": UNLIMITED, "standard": 0, "sheddable": 0}
    assert admission.retry_after_s["sheddable"] == SETTINGS.retry_after_max_s


def test_retry_after_follows_the_expected_drain_time() -> None:
    pods = [idle()]  # capacity 32
    light = admit(pods, load=load(standard=10, rate=8.0), envoys=1, settings=SETTINGS)
    assert light.retry_after_s["sheddable"] == 1  # a place is free now: the minimum
    heavy = admit(pods, load=load(critical=10, standard=60, rate=4.0), envoys=1, settings=SETTINGS)
    # 70 in flight for 32 places: 39 must finish first at 4/s, about 10 s (ladder: 10).
    assert heavy.retry_after_s["sheddable"] == 10
    assert heavy.retry_after_s["standard"] == 10
    slower = admit(pods, load=load(critical=10, standard=60, rate=1.0), envoys=1, settings=SETTINGS)
    assert slower.retry_after_s["sheddable"] == 40
    capped = admit(pods, load=load(standard=500, rate=1.0), envoys=1, settings=SETTINGS)
    assert capped.retry_after_s["sheddable"] == SETTINGS.retry_after_max_s
