"""Each pool's healthy endpoints, from the decision where it has the pool, else from the
config; and xds_pool_healthy_endpoints, one series per pool of the config in force."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from xds_server.config import RoutingConfig, parse_config
from xds_server.policy.decision import Decision
from xds_server.policy.state import EndpointState, Health, PoolState
from xds_server.telemetry.pools import PoolCollector, healthy_endpoints

CONFIG = """
pools:
  - name: scored
    models: [m]
    endpoints: [{address: 10.0.0.1, port: 80}, {address: 10.0.0.2, port: 80}]
  - name: static
    models: [n]
    gpu_aware: false
    endpoints: [{address: 10.0.1.1, port: 80}, {address: 10.0.1.2, port: 80, draining: true}]
  - name: drained
    models: [o]
    gpu_aware: false
    endpoints: [{address: 10.0.2.1, port: 80, draining: true}]
  - {name: empty, models: [p], allow_empty: true}
"""


@dataclass
class View:
    """The controller as the collector sees it (telemetry.bands.DecisionView)."""

    config: RoutingConfig | None
    decision: Decision = field(default_factory=Decision)


def _state(*health: Health) -> PoolState:
    return PoolState(
        name="scored",
        endpoints=tuple(
            EndpointState(address=f"10.0.0.{i + 1}", port=80, weight=1, health=h)
            for i, h in enumerate(health)
        ),
    )


def test_healthy_endpoints_follow_the_decision_else_the_config() -> None:
    config = parse_config(CONFIG)
    # Not decided yet: every listed endpoint not draining.
    assert healthy_endpoints(View(config)) == {"scored": 2, "static": 1, "drained": 0, "empty": 0}
    decided = Decision(pools={"scored": _state(Health.HEALTHY, Health.UNHEALTHY)})
    assert healthy_endpoints(View(config, decided))["scored"] == 1
    decided = Decision(pools={"scored": _state(Health.DRAINING, Health.UNHEALTHY)})
    assert healthy_endpoints(View(config, decided))["scored"] == 0
    # A pool the decision has but the config no longer does is not counted.
    gone = parse_config("pools: [{name: static, models: [n]}]")
    assert healthy_endpoints(View(gone, decided)) == {"static": 0}
    assert healthy_endpoints(View(None)) == {}


def _series(registry: CollectorRegistry, name: str) -> dict[str, float]:
    return {
        sample.labels["pool"]: sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name
    }


def test_the_gauge_has_one_series_per_pool_of_the_config_in_force() -> None:
    view = View(parse_config(CONFIG))
    registry = CollectorRegistry()
    registry.register(PoolCollector(view))

    def series() -> dict[str, float]:
        return _series(registry, "xds_pool_healthy_endpoints")

    assert series() == {"scored": 2, "static": 1, "drained": 0, "empty": 0}
    view.config = parse_config("pools: [{name: static, models: [n]}]")
    assert series() == {"static": 0}  # the other pools' series are gone
    view.config = None
    assert series() == {}


def test_affinity_suspension_has_a_series_per_decided_pool_with_session_affinity() -> None:
    affine = CONFIG.replace("  - name: scored\n", "  - name: scored\n    session_affinity: true\n")
    config = parse_config(affine)
    view = View(config, Decision(pools={"scored": _state(Health.HEALTHY)}))
    registry = CollectorRegistry()
    registry.register(PoolCollector(view))

    def series() -> dict[str, float]:
        return _series(registry, "xds_pool_affinity_suspended")

    assert series() == {"scored": 0.0}
    endpoints = _state(Health.HEALTHY).endpoints
    suspended = PoolState(name="scored", endpoints=endpoints, keys_suspended=True)
    view.decision = Decision(pools={"scored": suspended})
    assert series() == {"scored": 1.0}
    view.config = parse_config(CONFIG)  # the pool without session affinity: no series
    assert series() == {}
