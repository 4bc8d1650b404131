"""A pool's saturation: the signal to scale its model servers on (pure: no I/O).

    demand     requests running and waiting on the pool's ready pods, by their metrics
    capacity   what those pods serve at once without queueing: each one's nominal
               concurrency (`flow_control.pod_concurrency` by hardware class, else
               `default_pod_concurrency`), the same slots admission counts (admission.py)
    ratio      demand / capacity: above 1, requests queue in the pods

Unlike admission's capacity, a full pod is not counted at what it runs: a pool whose
pods queue must read as over 1, not as exactly full. The figures hold with or without
flow control, for every pool weighed from live metrics; an autoscaler (KEDA, an HPA on
external metrics) reads them from `xds_pool_saturation_ratio` and its two parts
(docs/operations.md, "Autoscaling model servers").

A ready pod is one in rotation (HEALTHY, spilling or not); a ready pod with no metrics
yet counts as idle, as admission counts it. A pool with no ready pod has no ratio: its
demand is unknown, and `xds_pool_healthy_endpoints` at 0 is the alert for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from xds_server.config import FlowControlConfig
from xds_server.policy.admission import PodCapacity, nominal_concurrency

__all__ = ["PoolSaturation", "saturation"]


@dataclass(frozen=True, kw_only=True)
class PoolSaturation:
    """A pool's demand and nominal capacity, in requests."""

    demand: float
    capacity: int

    @property
    def ratio(self) -> float | None:
        """Demand over capacity; None when no pod is ready (capacity 0)."""
        return self.demand / self.capacity if self.capacity else None


def saturation(pods: Iterable[PodCapacity], *, settings: FlowControlConfig) -> PoolSaturation:
    """The saturation of a pool whose ready pods are `pods` (their hardware class and the
    requests they last reported running and waiting)."""
    demand = 0.0
    capacity = 0
    for pod in pods:
        demand += max(0.0, pod.running) + max(0.0, pod.waiting)
        capacity += nominal_concurrency(pod.hardware, settings=settings)
    return PoolSaturation(demand=demand, capacity=capacity)
