"""Scraping model servers' metrics: what each pod says about its load.

`exposition` reads the few families the control plane needs from a Prometheus text page,
fast (pure); `engines` turns them into one `PodMetrics` per engine flavour (vLLM, SGLang,
TGI, Triton TensorRT-LLM, trtllm-serve; pure); `store` keeps the latest per pod, its age,
its error streak and its prefix-cache hit rate (pure state); `scraper` fetches every pod's
page on an interval into the store (the I/O). Its errors are in `xds_server.errors`.
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
from xds_server.metrics.exposition import Sample, parse_samples
from xds_server.metrics.scraper import Scraper, ScraperState, ScrapeTarget
from xds_server.metrics.store import ErrorStreak, MetricsStore, PodObservation

__all__ = [
    "EngineAdapter",
    "EngineKind",
    "ErrorStreak",
    "LogicalMetric",
    "MetricName",
    "MetricsStore",
    "PodMetrics",
    "PodObservation",
    "Sample",
    "ScrapeTarget",
    "Scraper",
    "ScraperState",
    "engine_adapter",
    "parse_samples",
]
