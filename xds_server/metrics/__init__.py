"""Scraping model servers' metrics: what each pod says about its load.

`exposition` reads the few families the control plane needs from a Prometheus text page,
fast (pure); `engines` turns them into one `PodMetrics` per engine flavour (vLLM, SGLang,
TGI, Triton TensorRT-LLM, trtllm-serve; pure); `store` keeps the latest per pod, its age,
its error streak and its prefix-cache hit rate (pure state); `scraper` fetches every pod's
page on an interval into the store (the I/O); `telemetry` counts scrapes in Prometheus.
"""

from __future__ import annotations

from xds_server.metrics.engines import (
    EngineAdapter,
    EngineKind,
    LogicalMetric,
    MetricName,
    PodMetrics,
    engine_adapter,
)
from xds_server.metrics.errors import (
    MetricsError,
    MetricsParseError,
    ScrapeError,
    ScrapeErrorKind,
)
from xds_server.metrics.exposition import Sample, parse_samples
from xds_server.metrics.scraper import Scraper, ScraperState, ScrapeTarget
from xds_server.metrics.store import ErrorStreak, MetricsStore, PodObservation
from xds_server.metrics.telemetry import ScrapeTelemetry

__all__ = [
    "EngineAdapter",
    "EngineKind",
    "ErrorStreak",
    "LogicalMetric",
    "MetricName",
    "MetricsError",
    "MetricsParseError",
    "MetricsStore",
    "PodMetrics",
    "PodObservation",
    "Sample",
    "ScrapeError",
    "ScrapeErrorKind",
    "ScrapeTarget",
    "ScrapeTelemetry",
    "Scraper",
    "ScraperState",
    "engine_adapter",
    "parse_samples",
]
