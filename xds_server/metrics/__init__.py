"""Scraping model servers' metrics: what each pod says about its load.

`exposition` reads the few families the control plane needs from a Prometheus text page,
fast (pure); `engines` turns them into one `PodMetrics` per engine flavour (vLLM, SGLang,
TGI, Triton TensorRT-LLM, trtllm-serve; pure); `store` keeps the latest per pod, its age,
its error streak and its prefix-cache hit rate (pure state); `scraper` fetches every pod's
page on an interval into the store (the I/O). Its errors are in `xds_server.errors`.

Pages are distrusted input: a pod's page sizes its share of traffic. A page is read up to a
byte cap (`fetching`), parsed up to sample and label caps (`exposition`), refused when it
holds values no pod can have (`engines`), and refused when it claims a KV cache far beyond
its peers' (the scraper's `check`, from sources/pod_metrics.py). A refused page is a failed
scrape: counted by kind (`too_large`, `implausible`), logged once per streak, never stored.
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
