"""Prometheus metrics about scraping, for the server's `/metrics`.

The scraper does not know Prometheus; it calls `observe_error` and `observe_scrape`, and
this class implements them. Pods are not a label: a thousand pods would make a thousand
series per metric, and the per-pod story (errors in a row, last error, age) is in the
store, for `/debug`. Registered in the server's own registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram

from xds_server.errors import ScrapeErrorKind

if TYPE_CHECKING:
    from xds_server.metrics.scraper import ErrorObserver, ScrapeObserver

__all__ = ["ScrapeTelemetry"]

_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ScrapeTelemetry:
    """`xds_scrape_errors_total{kind}` and `xds_scrape_duration_seconds`, in `registry`.

    Every error kind's series exists from the start at zero, so a rate over it is defined
    before the first failure.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "xds_scrape_errors",
            "Failed scrapes of model-server metrics pages, by kind of failure.",
            ["kind"],
            registry=registry,
        )
        for kind in ScrapeErrorKind:
            self.errors.labels(kind.value)
        self.duration = Histogram(
            "xds_scrape_duration_seconds",
            "Time to fetch and parse one model server's metrics page (successful scrapes).",
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )

    def observe_error(self, pod_id: str, kind: ScrapeErrorKind) -> None:
        self.errors.labels(kind.value).inc()

    def observe_scrape(self, pod_id: str, duration_s: float) -> None:
        self.duration.observe(duration_s)


if TYPE_CHECKING:  # ScrapeTelemetry's methods are the scraper's callbacks (checked by mypy)

    def _conforms(telemetry: ScrapeTelemetry) -> tuple[ErrorObserver, ScrapeObserver]:
        return telemetry.observe_error, telemetry.observe_scrape
