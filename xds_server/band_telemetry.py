"""Flow-control Prometheus metrics, per pool and band, read at scrape time.

Limits, Retry-After, capacity and saturation are what the controller last decided
(`DesiredState.admissions`); in-flight, admitted and refused requests are what the Envoys
reported over LRS. A collector, like pod_telemetry, so that pools and bands that go away
leave no stale series behind.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from xds_server.config import BANDS, Band
from xds_server.controller import Controller, band_clusters

__all__ = ["BandCollector", "BandTotals"]


class BandTotals(Protocol):
    """Requests the Envoys admitted to and refused from clusters, since the server started."""

    def admitted(self, clusters: list[str]) -> int: ...

    def refused(self, clusters: list[str]) -> int: ...


class BandCollector(Collector):
    """xds_band_* and xds_pool_* flow-control metrics."""

    def __init__(self, controller: Controller, totals: BandTotals | None) -> None:
        self._controller = controller
        self._totals = totals

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["pool", "band"]
        limit = GaugeMetricFamily(
            "xds_band_limit",
            "Requests of the band each Envoy admits at once (circuit breaker max_requests).",
            labels=labels,
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
            "xds_pool_capacity",
            "Requests the pool's ready pods serve at once without queueing.",
            labels=["pool"],
        )
        saturation = GaugeMetricFamily(
            "xds_pool_saturation",
            "Requests in flight over capacity (above 1: requests queue in the pods).",
            labels=["pool"],
        )
        config = self._controller.config
        admissions = self._controller.state.admissions
        pools = {p.name: p for p in config.pools} if config is not None else {}
        for name in sorted(admissions):
            admission = admissions[name]
            capacity.add_metric([name], admission.capacity)
            saturation.add_metric([name], admission.saturation)
            clusters: Mapping[Band, list[str]] = (
                band_clusters(config, pools[name]) if config is not None and name in pools else {}
            )
            for band in BANDS:
                limit.add_metric([name, band], admission.max_requests[band])
                in_flight.add_metric([name, band], admission.in_flight[band])
                retry_after.add_metric([name, band], admission.retry_after_s[band])
                if self._totals is not None and band in clusters:
                    admitted.add_metric([name, band], self._totals.admitted(clusters[band]))
                    refused.add_metric([name, band], self._totals.refused(clusters[band]))
        yield from (limit, in_flight, retry_after, admitted, refused, capacity, saturation)
