"""Each pool's healthy endpoints, from the latest decision: a metric, and /readyz's detail.

A pool with no healthy endpoint answers every request for its models 503
no_healthy_upstream while the server itself is well, so the server's readiness alone
cannot tell. `xds_pool_healthy_endpoints{pool}` at 0 is what an alert fires on, and
/readyz names such pools (admin.py). A collector, like pods.py, so that a pool that goes
away leaves no stale series behind.

Healthy means what the server sends Envoy: an endpoint the policy decided HEALTHY in a
pool it weighs (GPU-aware: `policy.state.Health`), a listed endpoint that is not draining
in any other pool (its endpoints go to Envoy as the config lists them). Envoy's own
ejections (outlier detection) are not seen here: Envoy's `cluster.<pool>.membership_healthy`
is.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from xds_server.policy.state import Health
from xds_server.telemetry.bands import DecisionView

__all__ = ["PoolCollector", "healthy_endpoints"]


def healthy_endpoints(view: DecisionView) -> dict[str, int]:
    """The healthy endpoints of each pool of the config in force, by pool name in config
    order; empty before the first config. A pool takes its count from the latest decision
    when the decision has it, as the snapshot builder takes its endpoints (so a config
    change shows once it is decided, after its debounce), else from its config."""
    config = view.config
    if config is None:
        return {}
    decided = view.decision.pools
    counts = {}
    for pool in config.pools:
        state = decided.get(pool.name)
        if state is not None:
            counts[pool.name] = sum(1 for e in state.endpoints if e.health is Health.HEALTHY)
        else:
            counts[pool.name] = sum(1 for e in pool.endpoints if not e.draining)
    return counts


class PoolCollector(Collector):
    """xds_pool_healthy_endpoints: one series per pool of the config in force; and
    xds_pool_affinity_suspended, one per decided pool with session affinity."""

    def __init__(self, decisions: DecisionView) -> None:
        self._decisions = decisions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "xds_pool_healthy_endpoints",
            "Endpoints of the pool sent to Envoy as healthy (0: every request for its models"
            " is answered 503 no_healthy_upstream).",
            labels=["pool"],
        )
        for name, count in healthy_endpoints(self._decisions).items():
            family.add_metric([name], count)
        yield family
        suspended = GaugeMetricFamily(
            "xds_pool_affinity_suspended",
            "1 while the pool's session keys are balanced by load instead of sticking to"
            " their pods: its prefix caches save too little per request for stickiness to"
            " pay (reason affinity_suspended on /debug/decision), else 0.",
            labels=["pool"],
        )
        config = self._decisions.config
        affine = {p.name for p in config.pools if p.session_affinity} if config else set()
        for name, state in self._decisions.decision.pools.items():
            if name in affine:
                suspended.add_metric([name], float(state.keys_suspended))
        yield suspended
