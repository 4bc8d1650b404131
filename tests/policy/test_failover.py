"""The failover policy (policy/failover.py) over time, on a fake clock: failover at once
when no local pod is healthy, a hold, then a ramp that follows the pods' load, a back-off
when they fill up, shedding when saturated, and the remotes' summaries."""

from __future__ import annotations

from xds_server.config import FlowControlConfig, PoolConfig
from xds_server.policy.failover import (
    FailoverMemory,
    PoolFailover,
    PoolSummary,
    RemoteView,
    plan_pool,
)
from xds_server.policy.signals import PodSignals
from xds_server.policy.state import EndpointState, Health, PoolState

POOL = PoolConfig.model_validate(
    {
        "name": "gpu",
        "models": ["m"],
        "batch_limit": 10,
        "endpoints": [{"address": "10.0.0.1", "port": 8000}, {"address": "10.0.0.2", "port": 8000}],
        "remotes": [
            {"name": "east", "address": "192.0.2.1", "port": 443, "peer": "192.0.2.1:18000"},
            {"name": "west", "address": "192.0.2.2", "port": 443},
        ],
        "failover": {"hold_s": 2, "ramp_s": 4, "step_s": 1},
    }
)
VIEWS = {
    "east": RemoteView(addresses=("192.0.2.1",)),
    "west": RemoteView(addresses=("192.0.2.2",)),
}


def _state(healthy: bool) -> PoolState:
    health = Health.HEALTHY if healthy else Health.UNHEALTHY
    return PoolState(
        name="gpu",
        endpoints=tuple(
            EndpointState(address=f"10.0.0.{i}", port=8000, weight=10, health=health)
            for i in (1, 2)
        ),
    )


def _signals(running: float, waiting: float = 0.0) -> dict[str, PodSignals]:
    return {
        f"10.0.0.{i}:8000": PodSignals(silent_s=0, running=running, waiting=waiting)
        for i in (1, 2)
    }


def _plan(
    memory: FailoverMemory,
    now: float,
    *,
    healthy: bool = True,
    running: float = 0.0,
    waiting: float = 0.0,
    views: dict[str, RemoteView] | None = None,
) -> tuple[PoolFailover, FailoverMemory]:
    return plan_pool(
        POOL,
        _state(healthy),
        _signals(running, waiting),
        remotes=VIEWS if views is None else views,
        flow_control=FlowControlConfig(),
        memory=memory,
        now=now,
    )


def test_all_local_while_the_pods_are_healthy_and_not_saturated() -> None:
    plan, memory = _plan(FailoverMemory(), 0.0, running=9)
    assert plan.share == 1.0 and not plan.active and plan.remote_share == 0.0
    assert [(t.remote, t.usable) for t in plan.targets] == [("east", True), ("west", True)]
    assert memory.failovers == 0


def test_no_healthy_pod_fails_over_at_once_then_holds_and_ramps_with_room() -> None:
    plan, memory = _plan(FailoverMemory(), 0.0, healthy=False)
    assert plan.share == 0.0 and plan.active and plan.remote_share == 1.0
    assert memory.failovers == 1
    # Back, but held for hold_s (2 s) with nothing.
    shares = []
    for now in (1.0, 2.0, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0):
        plan, memory = _plan(memory, now)
        shares.append(plan.share)
    assert shares == [0.0, 0.0, 0.25, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert not plan.active and memory.failovers == 1


def test_the_ramp_holds_while_the_pods_are_busy_and_backs_off_when_they_fill() -> None:
    memory = FailoverMemory(share=0.5, healthy_since=-10.0, stepped_at=-10.0)
    plan, memory = _plan(memory, 0.0, running=9)  # 0.9 of the batch: hold
    assert plan.share == 0.5 and "holding" in plan.reason
    plan, memory = _plan(memory, 1.0, running=5, waiting=1)  # a pod queues: no growth
    assert plan.share == 0.5
    plan, memory = _plan(memory, 2.0, running=10, waiting=2)  # full: halve
    assert plan.share == 0.25 and "backing off" in plan.reason
    plan, memory = _plan(memory, 2.5, running=10, waiting=2)  # not before step_s
    assert plan.share == 0.25
    for now in (4.0, 5.0, 6.0):
        plan, memory = _plan(memory, now, running=2)
    assert plan.share == 1.0


def test_a_saturated_pool_sheds_to_its_remotes_and_keeps_a_least_share() -> None:
    plan, memory = _plan(FailoverMemory(), 0.0, running=10, waiting=6)  # 1.6 >= 1.5
    assert plan.share == 0.5 and plan.active and memory.failovers == 1
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        plan, memory = _plan(memory, now, running=10, waiting=6)
    assert plan.share == POOL.failover.min_share


def test_a_remote_down_or_failing_over_gets_nothing_and_the_least_saturated_more() -> None:
    views = {
        "east": RemoteView(
            addresses=("192.0.2.1", "192.0.2.3"),
            linked=True,
            summary=PoolSummary(healthy=4, endpoints=4, saturation=0.2, capacity=40),
        ),
        "west": RemoteView(
            addresses=("192.0.2.2",),
            summary=PoolSummary(healthy=4, endpoints=4, saturation=0.8, capacity=40),
        ),
    }
    plan, _ = _plan(FailoverMemory(), 0.0, healthy=False, views=views)
    weights = {(t.remote, t.address): t.weight for t in plan.targets}
    assert weights == {
        ("east", "192.0.2.1"): 80,
        ("east", "192.0.2.3"): 80,
        ("west", "192.0.2.2"): 20,
    }
    views["east"] = RemoteView(
        addresses=("192.0.2.1",),
        summary=PoolSummary(healthy=0, endpoints=4, saturation=None, capacity=0),
    )
    views["west"] = RemoteView(
        addresses=("192.0.2.2",),
        summary=PoolSummary(healthy=4, endpoints=4, saturation=0.1, capacity=40, failing_over=True),
    )
    plan, _ = _plan(FailoverMemory(), 0.0, healthy=False, views=views)
    assert not plan.usable and not plan.active and plan.remote_share == 0.0


def test_a_pool_the_policy_does_not_decide_keeps_its_remotes_at_full_local_share() -> None:
    plan, memory = plan_pool(
        POOL, None, {}, remotes=VIEWS, flow_control=FlowControlConfig(),
        memory=FailoverMemory(), now=0.0,
    )  # fmt: skip
    assert plan.share == 1.0 and len(plan.targets) == 2 and memory == FailoverMemory()


def test_the_ramp_waits_while_one_pod_has_a_full_batch_though_the_pool_has_room() -> None:
    memory = FailoverMemory(share=0.5, healthy_since=-10.0, stepped_at=-10.0)
    signals = {
        "10.0.0.1:8000": PodSignals(silent_s=0, running=10, waiting=0),
        "10.0.0.2:8000": PodSignals(silent_s=0, running=0, waiting=0),
    }
    plan, _ = plan_pool(
        POOL, _state(True), signals, remotes=VIEWS, flow_control=FlowControlConfig(),
        memory=memory, now=0.0,
    )  # fmt: skip
    assert plan.share == 0.5 and "holding" in plan.reason
