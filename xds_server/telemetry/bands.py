"""Flow-control Prometheus metrics, per pool and band, read at scrape time.

Budgets, the spread of the Envoys' limits, Retry-After, admission's capacity and requests in
flight (over the fleet) are what the policy last decided from (`Decision.admissions`); admitted
and refused requests are what this replica's Envoys reported over LRS, by pool and band.
A collector, like pods.py, so that pools, bands and Envoys that go away leave no stale
series behind.

With weighted tenants, xds_tenant_* say the same per pool, band and tenant lane (`*`: the
band's shared lane, the requests of no weighted tenant): its part of the band's budget,
its requests in flight over the fleet, and what this replica's Envoys admitted and refused
on it (a weighted tenant's refusals are its 429 `tenant_share_exceeded`). Their number is
pools × 2 bands × (weighted tenants + 1), bounded as the tenants' lanes are.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from xds_server.config import BANDS, Band, RoutingConfig
from xds_server.policy.admission import PoolAdmission
from xds_server.policy.decision import Decision

__all__ = ["BandCollector", "BandTotals", "BandTotalsSource", "DecisionView"]


class DecisionView(Protocol):
    """The config in force and the policy's latest decision (the controller has both)."""

    @property
    def config(self) -> RoutingConfig | None: ...

    @property
    def decision(self) -> Decision: ...


@dataclass(frozen=True, kw_only=True)
class BandTotals:
    """Requests of one pool's band the Envoys sent to a pod, and refused with 429 (circuit
    breaker overflow), since the server started."""

    admitted: int
    refused: int


class BandTotalsSource(Protocol):
    """Admitted and refused requests per (pool, band) of `config`, and per (pool, band,
    weighted tenant)."""

    def band_totals(self, config: RoutingConfig) -> Mapping[tuple[str, Band], BandTotals]: ...

    def tenant_totals(
        self, config: RoutingConfig
    ) -> Mapping[tuple[str, Band, str], BandTotals]: ...


class BandCollector(Collector):
    """xds_band_* and xds_pool_admission_capacity_requests: flow control's metrics."""

    def __init__(self, decisions: DecisionView, totals: BandTotalsSource | None) -> None:
        self._decisions = decisions
        self._totals = totals

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["pool", "band"]
        limit = GaugeMetricFamily(
            "xds_band_limit",
            "Requests of the band an Envoy not yet named by a decision admits at once (the"
            " floor; circuit breaker max_requests).",
            labels=labels,
        )
        budget = GaugeMetricFamily(
            "xds_band_budget",
            "Requests of the band the whole fleet of Envoys admits at once.",
            labels=labels,
        )
        # Per Envoy would be pools x bands x Envoys series (150,000 for 100 pools and
        # 500 Envoys, a second of the event loop per scrape): the spread instead, and
        # each Envoy's own on /debug/nodes.
        envoy_min = GaugeMetricFamily(
            "xds_band_envoy_limit_min",
            "The smallest part of the band's budget an Envoy holds (requests it admits at"
            " once).",
            labels=labels,
        )
        envoy_max = GaugeMetricFamily(
            "xds_band_envoy_limit_max",
            "The largest part of the band's budget an Envoy holds.",
            labels=labels,
        )
        envoys = GaugeMetricFamily(
            "xds_fleet_envoys",
            "Envoys the budgets are split over: this replica's and its peers'.",
        )
        in_flight = GaugeMetricFamily(
            "xds_band_in_flight",
            "Requests of the band in flight over every Envoy (LRS).",
            labels=labels,
        )
        retry_after = GaugeMetricFamily(
            "xds_band_retry_after_seconds",
            "The Retry-After a refused request of the band gets now.",
            labels=labels,
        )
        admitted = CounterMetricFamily(
            "xds_band_admitted", "Requests of the band Envoys sent to a pod (LRS).", labels=labels
        )
        refused = CounterMetricFamily(
            "xds_band_refused",
            "Requests of the band Envoys refused with 429 (circuit breaker overflow, LRS).",
            labels=labels,
        )
        capacity = GaugeMetricFamily(
            "xds_pool_admission_capacity_requests",
            "Requests the pool's ready pods serve at once as admission counts them: a pod"
            " that queues, or whose KV cache is full, at what it runs now (the band"
            " budgets share this).",
            labels=["pool"],
        )
        config = self._decisions.config
        admissions = self._decisions.decision.admissions
        totals: Mapping[tuple[str, Band], BandTotals] = (
            self._totals.band_totals(config)
            if self._totals is not None and config is not None
            else {}
        )
        yield from self._tenants(config, admissions)
        for name in sorted(admissions):
            admission = admissions[name]
            capacity.add_metric([name], admission.capacity)
            for band in BANDS:
                limit.add_metric([name, band], admission.max_requests[band])
                budget.add_metric([name, band], admission.budget[band])
                parts = [limits[band] for limits in admission.by_envoy.values()]
                if parts:
                    envoy_min.add_metric([name, band], min(parts))
                    envoy_max.add_metric([name, band], max(parts))
                in_flight.add_metric([name, band], admission.in_flight[band])
                retry_after.add_metric([name, band], admission.retry_after_s[band])
                counted = totals.get((name, band))
                if counted is not None:
                    admitted.add_metric([name, band], counted.admitted)
                    refused.add_metric([name, band], counted.refused)
        envoys.add_metric([], len({node for a in admissions.values() for node in a.by_envoy}))
        yield from (
            limit,
            budget,
            envoy_min,
            envoy_max,
            envoys,
            in_flight,
            retry_after,
            admitted,
            refused,
            capacity,
        )

    def _tenants(
        self, config: RoutingConfig | None, admissions: Mapping[str, PoolAdmission]
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """xds_tenant_*: each lane's part, in flight, admitted and refused (module
        docstring)."""
        labels = ["pool", "band", "tenant"]
        share = GaugeMetricFamily(
            "xds_tenant_share",
            "Requests of the band the tenant's lane admits at once over the fleet: its fair"
            " share of the band's budget by weight, held at it while it drains (tenant *:"
            " the shared lane).",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "xds_tenant_in_flight",
            "Requests of the tenant's lane of the band in flight over every Envoy (LRS).",
            labels=labels,
        )
        admitted = CounterMetricFamily(
            "xds_tenant_admitted",
            "Requests of the weighted tenant's lane Envoys sent to a pod (LRS).",
            labels=labels,
        )
        refused = CounterMetricFamily(
            "xds_tenant_refused",
            "Requests of the weighted tenant Envoys refused with 429 tenant_share_exceeded"
            " (its lane's circuit breaker, LRS).",
            labels=labels,
        )
        for name in sorted(admissions):
            for band, split in sorted(admissions[name].tenants.items()):
                for tenant in sorted(split.parts):
                    share.add_metric([name, band, tenant], split.parts[tenant])
                    in_flight.add_metric([name, band, tenant], split.in_flight.get(tenant, 0))
        if self._totals is not None and config is not None:
            for (pool, band, tenant), counted in sorted(self._totals.tenant_totals(config).items()):
                admitted.add_metric([pool, band, tenant], counted.admitted)
                refused.add_metric([pool, band, tenant], counted.refused)
        yield from (share, in_flight, admitted, refused)
