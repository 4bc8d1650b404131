"""A pool's saturation: requests running and waiting on its ready pods over their nominal
concurrency, by hardware class, whatever admission would make of a full pod."""

from __future__ import annotations

import pytest

from xds_server.config import FlowControlConfig
from xds_server.policy.admission import PodCapacity, pod_capacity
from xds_server.policy.saturation import saturation

SETTINGS = FlowControlConfig(pod_concurrency={"h100": 48, "a10g": 8}, default_pod_concurrency=16)


def pod(hardware: str | None, running: float = 0.0, waiting: float = 0.0) -> PodCapacity:
    return PodCapacity(hardware=hardware, running=running, waiting=waiting)


def test_demand_over_each_pods_nominal_concurrency_by_hardware_class() -> None:
    figures = saturation(
        [pod("h100", running=30), pod("a10g", running=8, waiting=4), pod(None, running=2)],
        settings=SETTINGS,
    )
    assert figures.capacity == 48 + 8 + 16
    assert figures.demand == 30 + 8 + 4 + 2
    assert figures.ratio == pytest.approx(44 / 72)


def test_a_queueing_pool_reads_above_one_where_admission_counts_it_full() -> None:
    """Admission counts a pod that queues at what it runs; saturation keeps its slots, so
    the queue shows as a ratio above 1, not as exactly 1."""
    queueing = [pod("a10g", running=8, waiting=6), pod("a10g", running=8, waiting=2)]
    figures = saturation(queueing, settings=SETTINGS)
    assert (figures.demand, figures.capacity) == (24, 16)
    assert figures.ratio == 1.5
    assert sum(pod_capacity(p, settings=SETTINGS) for p in queueing) == 16


def test_an_idle_pool_is_at_zero_and_a_pool_without_ready_pods_has_no_ratio() -> None:
    idle = saturation([pod("h100"), pod("h100")], settings=SETTINGS)
    assert (idle.demand, idle.capacity, idle.ratio) == (0.0, 96, 0.0)
    none = saturation([], settings=SETTINGS)
    assert (none.demand, none.capacity, none.ratio) == (0.0, 0, None)


def test_without_flow_control_settings_the_defaults_apply() -> None:
    figures = saturation([pod("h100", running=16)], settings=FlowControlConfig())
    assert (figures.capacity, figures.ratio) == (32, 0.5)
