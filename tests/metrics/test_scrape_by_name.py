"""Scrapes that ask for only the series read (`?name[]=...`): a real prometheus-client
server (what vLLM and SGLang serve /metrics with) answers just those, and the pod reads the
same as from its whole page."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from yarl import URL

from llm_sim.metrics_text import Flavour
from llm_sim.pod import SimulatedPod
from xds_server.metrics.engines import EngineKind, PodMetrics, engine_adapter
from xds_server.metrics.fetching import HttpPageFetcher
from xds_server.metrics.scraper import Scraper, ScrapeTarget
from xds_server.metrics.store import MetricsStore


def test_only_prometheus_client_engines_are_asked_by_name() -> None:
    vllm = ScrapeTarget(url="http://10.0.0.1:8000/metrics", engine="vllm", by_name=True)
    asked = vllm.parsed_url.query.getall("name[]")
    assert sorted(asked) == sorted(engine_adapter(EngineKind.VLLM).families)
    assert "vllm:num_requests_waiting" in asked and "vllm:prefix_cache_hits_total" in asked
    # TGI's and Triton's exporters do not know the parameter: their URL stays as it is.
    for engine in ("tgi", "triton"):
        target = ScrapeTarget(url="http://10.0.0.1:8000/metrics", engine=engine, by_name=True)
        assert not target.parsed_url.query
    assert not ScrapeTarget(url="http://10.0.0.1:8000/metrics", engine="vllm").parsed_url.query


@pytest.fixture
def prometheus_client_pod() -> Iterator[tuple[str, CollectorRegistry]]:
    """A vLLM-named page served by prometheus-client's own HTTP server, with families the
    server does not read around the ones it does."""
    registry = CollectorRegistry()
    labels = {"engine": "0", "model_name": "m"}
    Gauge("vllm:num_requests_waiting", "w", list(labels), registry=registry).labels(
        **labels
    ).set(3)
    Gauge("vllm:num_requests_running", "r", list(labels), registry=registry).labels(
        **labels
    ).set(5)
    Gauge("vllm:kv_cache_usage_perc", "kv", list(labels), registry=registry).labels(
        **labels
    ).set(0.5)
    Counter("vllm:prefix_cache_hits", "h", list(labels), registry=registry).labels(
        **labels
    ).inc(40)
    Counter("vllm:prefix_cache_queries", "q", list(labels), registry=registry).labels(
        **labels
    ).inc(100)
    for i in range(40):  # what a real page has plenty of: families nobody here reads
        Gauge(f"vllm:unread_{i}", "u", list(labels), registry=registry).labels(**labels).set(i)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics", registry
    finally:
        server.shutdown()
        thread.join(timeout=5)


class MeasuringFetcher(HttpPageFetcher):
    """The real HTTP fetcher, noting the size of each page it got."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    async def fetch(self, url: URL, *, timeout_s: float, max_bytes: int) -> bytes:
        body = await super().fetch(url, timeout_s=timeout_s, max_bytes=max_bytes)
        self.sizes.append(len(body))
        return body


async def _scrape_once(target: ScrapeTarget) -> tuple[PodMetrics | None, int]:
    """What one scrape of `target` reads, and the bytes of the page it got."""
    store, fetcher = MetricsStore(), MeasuringFetcher()
    async with Scraper(store, interval_s=0.05, fetcher=fetcher, _iterations=1) as scraper:
        scraper.set_targets({"pod": target})
        await asyncio.wait_for(scraper.join(), 10)
    observation = store.observation("pod", now=0.0)
    assert observation is not None and observation.errors_in_a_row == 0
    return observation.metrics, fetcher.sizes[0]


async def test_a_prometheus_client_server_sends_only_the_series_asked_for(
    prometheus_client_pod: tuple[str, CollectorRegistry],
) -> None:
    url, _ = prometheus_client_pod
    whole, whole_bytes = await _scrape_once(ScrapeTarget(url=url, engine="vllm"))
    named, named_bytes = await _scrape_once(ScrapeTarget(url=url, engine="vllm", by_name=True))
    assert named_bytes * 4 < whole_bytes
    assert named is not None and named == whole
    assert (named.waiting, named.running) == (3, 5)
    assert named.kv_usage == 0.5 and named.prefix_cache_hits_tokens == 40


@pytest.mark.parametrize("flavour", [Flavour.VLLM, Flavour.SGLANG])
async def test_the_simulator_answers_name_filters_as_prometheus_client_does(
    flavour: Flavour,
) -> None:
    async with SimulatedPod("p", flavour=flavour) as pod:
        url, engine = f"{pod.url}/metrics", flavour.value
        whole, whole_bytes = await _scrape_once(ScrapeTarget(url=url, engine=engine))
        named, named_bytes = await _scrape_once(ScrapeTarget(url=url, engine=engine, by_name=True))
    assert named_bytes * 4 < whole_bytes
    assert named is not None and named == whole
