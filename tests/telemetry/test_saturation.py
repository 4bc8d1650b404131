"""xds_pool_saturation_ratio and its parts, for every pool the decision weighs: the ready
pods' requests (their last metrics) over their nominal concurrency (flow_control's slots by
hardware class), with flow control on or off."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tests.telemetry.test_pods import Pods, View, observed
from xds_server.config import parse_config
from xds_server.policy.decision import Decision
from xds_server.policy.state import EndpointState, Health, PoolState
from xds_server.telemetry.saturation import SaturationCollector, pool_saturations

CONFIG = """
flow_control:
  pod_concurrency: {h100: 48, a10g: 8}
  default_pod_concurrency: 16
pools:
  - name: busy
    models: [m]
    endpoints:
      - {address: 10.0.0.1, port: 80, hardware: a10g}
      - {address: 10.0.0.2, port: 80, hardware: a10g}
      - {address: 10.0.0.3, port: 80, hardware: h100}
      - {address: 10.0.0.4, port: 80}
  - name: down
    models: [n]
    endpoints: [{address: 10.0.1.1, port: 80}]
  - {name: static, models: [o], gpu_aware: false, endpoints: [{address: 10.0.2.1, port: 80}]}
"""


def _endpoint(address: str, hardware: str | None, health: Health) -> EndpointState:
    return EndpointState(address=address, port=80, weight=1, hardware=hardware, health=health)


DECISION = Decision(
    pools={
        "busy": PoolState(
            name="busy",
            endpoints=(
                _endpoint("10.0.0.1", "a10g", Health.HEALTHY),
                _endpoint("10.0.0.2", "a10g", Health.HEALTHY),
                # Out of rotation: neither its requests nor its slots count.
                _endpoint("10.0.0.3", "h100", Health.UNHEALTHY),
                # Ready, no metrics yet: idle, as admission counts it.
                _endpoint("10.0.0.4", None, Health.HEALTHY),
            ),
        ),
        "down": PoolState(name="down", endpoints=(_endpoint("10.0.1.1", None, Health.DRAINING),)),
    }
)


def pods() -> Pods:
    return Pods(
        {
            "10.0.0.1:80": observed(running=8, waiting=10, kv=0.9),
            "10.0.0.2:80": observed(running=8, waiting=6, kv=0.9),
            "10.0.0.3:80": observed(running=40, waiting=40, kv=1.0),
            "10.0.1.1:80": observed(running=3, waiting=0, kv=0.1),
        }
    )


def test_each_weighed_pool_gets_its_ready_pods_demand_over_their_slots() -> None:
    figures = pool_saturations(View(parse_config(CONFIG), DECISION), pods().observations())
    assert list(figures) == ["busy", "down"]  # the static pool is not weighed
    busy = figures["busy"]
    assert (busy.demand, busy.capacity) == (32, 8 + 8 + 16)
    assert busy.ratio == 1.0
    assert (figures["down"].capacity, figures["down"].ratio) == (0, None)
    assert pool_saturations(View(None, DECISION), pods().observations()) == {}


def test_the_collector_exports_ratio_demand_and_capacity_per_pool() -> None:
    view, source = View(parse_config(CONFIG), DECISION), pods()
    registry = CollectorRegistry()
    registry.register(SaturationCollector(source, view))

    def sample(name: str, pool: str) -> float | None:
        return registry.get_sample_value(name, {"pool": pool})

    assert sample("xds_pool_saturation_ratio", "busy") == 1.0
    assert sample("xds_pool_demand_requests", "busy") == 32
    assert sample("xds_pool_capacity_requests", "busy") == 32
    # No ready pod: demand and capacity 0, and no ratio for an autoscaler to misread.
    assert sample("xds_pool_capacity_requests", "down") == 0
    assert sample("xds_pool_saturation_ratio", "down") is None
    assert sample("xds_pool_saturation_ratio", "static") is None

    # The pods drain their queues: the ratio follows at the next scrape.
    source.by_id["10.0.0.1:80"] = observed(running=4, waiting=0, kv=0.3)
    source.by_id["10.0.0.2:80"] = observed(running=4, waiting=0, kv=0.3)
    assert sample("xds_pool_saturation_ratio", "busy") == pytest.approx(8 / 32)
