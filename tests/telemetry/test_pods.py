"""xds_pod_* label a pod so that its series join with the model server's own: the
endpoint (IP:port), the Kubernetes pod and namespace when known (else the configured
name, else the endpoint), and the hardware class; never `pod`, Prometheus' target label."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from xds_server.config import RoutingConfig, parse_config
from xds_server.metrics.engines import PodMetrics
from xds_server.metrics.store import PodObservation
from xds_server.policy.decision import Decision
from xds_server.policy.state import EndpointState, PoolState
from xds_server.telemetry.pods import LABELS, PodCollector

CONFIG = """
pools:
  - name: gpu
    models: [m]
    endpoints:
      - {address: 10.0.0.1, port: 80}
      - {address: 10.0.0.2, port: 80, name: vllm-b, hardware: h100}
      - {address: 10.0.0.3, port: 80, name: ml/vllm-c, namespace: ml, hardware: a10g}
"""


@dataclass
class View:
    """The controller as the collector sees it (telemetry.bands.DecisionView)."""

    config: RoutingConfig | None
    decision: Decision = field(default_factory=Decision)


@dataclass
class Pods:
    """The pod metrics source as the collector sees it (telemetry.pods.Observations)."""

    by_id: dict[str, PodObservation] = field(default_factory=dict)

    def observations(self) -> Mapping[str, PodObservation]:
        return self.by_id


def observed(running: int, waiting: int, kv: float) -> PodObservation:
    return PodObservation(
        metrics=PodMetrics(running=running, waiting=waiting, kv_usage=kv),
        age_s=0.5,
        prefix_hit_rate=None,
        errors_in_a_row=0,
        failing_for_s=None,
        last_error=None,
    )


def test_every_pod_series_names_the_pod_by_endpoint_kubernetes_pod_and_hardware() -> None:
    decided = PoolState(
        name="gpu",
        endpoints=(
            EndpointState(address="10.0.0.1", port=80, weight=3),
            EndpointState(address="10.0.0.2", port=80, weight=2, name="vllm-b", hardware="h100"),
            EndpointState(address="10.0.0.3", port=80, weight=1, name="ml/vllm-c"),
            # Decided before the config in force dropped it: the decided state names it.
            EndpointState(address="10.0.0.9", port=80, weight=1, name="old", hardware="l4"),
        ),
    )
    view = View(parse_config(CONFIG), Decision(pools={"gpu": decided}))
    pods = Pods({"10.0.0.3:80": observed(running=5, waiting=2, kv=0.4)})
    registry = CollectorRegistry()
    registry.register(PodCollector(pods, view))

    weights = {
        tuple(sample.labels[label] for label in LABELS): sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "xds_pod_weight"
    }
    assert weights == {
        ("gpu", "10.0.0.1:80", "10.0.0.1:80", "", ""): 3,
        ("gpu", "10.0.0.2:80", "vllm-b", "", "h100"): 2,
        ("gpu", "10.0.0.3:80", "vllm-c", "ml", "a10g"): 1,
        ("gpu", "10.0.0.9:80", "old", "", "l4"): 1,
    }
    c = {
        "pool": "gpu",
        "endpoint": "10.0.0.3:80",
        "model_server_pod": "vllm-c",
        "model_server_namespace": "ml",
        "hardware": "a10g",
    }
    assert registry.get_sample_value("xds_pod_kv_cache_usage_ratio", c) == 0.4
    assert registry.get_sample_value("xds_pod_requests_waiting", c) == 2
    assert registry.get_sample_value("xds_pod_state", {**c, "state": "healthy", "reason": "none"})
    for family in registry.collect():
        for sample in family.samples:
            assert "pod" not in sample.labels, sample
            assert set(LABELS) <= set(sample.labels), sample
