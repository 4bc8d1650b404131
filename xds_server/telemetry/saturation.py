"""Each pool's saturation, the signal to autoscale its model servers on, read at scrape time.

    xds_pool_demand_requests     requests running and waiting on the pool's ready pods
    xds_pool_capacity_requests   what those pods serve at once (nominal concurrency)
    xds_pool_saturation_ratio    the first over the second (above 1: requests queue)

For every pool weighed from live metrics (GPU-aware), with or without flow control: the
ready pods are the latest decision's HEALTHY ones, their load is what their last good
metrics page said (policy/saturation.py has the rules). A collector, like pods.py, so a
pool that goes away leaves no stale series behind.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from xds_server.metrics.store import PodObservation
from xds_server.policy.admission import PodCapacity
from xds_server.policy.saturation import PoolSaturation, saturation
from xds_server.policy.state import Health, PoolState
from xds_server.telemetry.bands import DecisionView
from xds_server.telemetry.pods import Observations

__all__ = ["SaturationCollector", "pool_saturations"]


def _ready_pods(
    state: PoolState, observations: Mapping[str, PodObservation]
) -> Iterator[PodCapacity]:
    for endpoint in state.endpoints:
        if endpoint.health is not Health.HEALTHY:
            continue
        observation = observations.get(endpoint.id)
        metrics = observation.metrics if observation is not None else None
        yield PodCapacity(
            hardware=endpoint.hardware,
            running=metrics.running if metrics is not None else 0.0,
            waiting=metrics.waiting if metrics is not None else 0.0,
        )


def pool_saturations(
    view: DecisionView, observations: Mapping[str, PodObservation]
) -> dict[str, PoolSaturation]:
    """The saturation of each pool the latest decision weighed, by name (sorted); empty
    before the first config."""
    config = view.config
    if config is None:
        return {}
    pools = view.decision.pools
    return {
        name: saturation(_ready_pods(pools[name], observations), settings=config.flow_control)
        for name in sorted(pools)
    }


class SaturationCollector(Collector):
    """xds_pool_demand_requests, xds_pool_capacity_requests and xds_pool_saturation_ratio."""

    def __init__(self, pods: Observations, decisions: DecisionView) -> None:
        self._pods = pods
        self._decisions = decisions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        demand = GaugeMetricFamily(
            "xds_pool_demand_requests",
            "Requests running and waiting on the pool's ready pods, by their metrics.",
            labels=["pool"],
        )
        capacity = GaugeMetricFamily(
            "xds_pool_capacity_requests",
            "Requests the pool's ready pods serve at once without queueing: each one's"
            " flow_control.pod_concurrency for its hardware class, else"
            " default_pod_concurrency.",
            labels=["pool"],
        )
        ratio = GaugeMetricFamily(
            "xds_pool_saturation_ratio",
            "Demand over capacity of the pool's ready pods (above 1: requests queue in the"
            " pods); absent while no pod is ready. The signal to autoscale model servers on.",
            labels=["pool"],
        )
        for name, figures in pool_saturations(self._decisions, self._pods.observations()).items():
            demand.add_metric([name], figures.demand)
            capacity.add_metric([name], figures.capacity)
            if figures.ratio is not None:
                ratio.add_metric([name], figures.ratio)
        yield from (demand, capacity, ratio)
