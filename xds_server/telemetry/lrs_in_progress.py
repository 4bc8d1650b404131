"""`xds_lrs_requests_in_progress{cluster}`: the Envoys' load reports, read at scrape time.

A collector, so that clusters no Envoy reports any more leave no stale series behind. It
reads the reports through `InProgressSource` (xds/load_reports.py's LoadReports), which
registers it.
"""

from __future__ import annotations

from collections.abc import Iterator, Set
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["InProgressCollector", "InProgressSource"]


class InProgressSource(Protocol):
    """Requests in flight per cluster, summed over the connected Envoys."""

    def clusters(self) -> Set[str]: ...

    def in_progress(self, cluster: str) -> int: ...


class InProgressCollector(Collector):
    """xds_lrs_requests_in_progress, one series per reported cluster."""

    def __init__(self, reports: InProgressSource) -> None:
        self._reports = reports

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "xds_lrs_requests_in_progress",
            "Requests in flight per cluster, summed over the connected Envoys' load reports.",
            labels=["cluster"],
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for cluster in sorted(self._reports.clusters()):
            family.add_metric([cluster], self._reports.in_progress(cluster))
        yield family
