"""The parser on published pages of the engines other than vLLM (tests/fixtures/engines/,
sources in its SOURCES.md), vLLM 0.30+'s LoRA series as it writes them, and metric names
renamed by the routing config, read end to end through the scraper."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from llm_sim.metrics_text import Flavour
from llm_sim.pod import SimulatedPod
from llm_sim.profiles import H100
from tests.metrics.scraping import wait_until
from xds_server.config import parse_config
from xds_server.metrics.engines import PodMetrics, engine_adapter
from xds_server.metrics.scraper import Scraper
from xds_server.metrics.store import MetricsStore
from xds_server.sources.pod_metrics import scrape_targets, signals_of

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engines"
SGLANG_DOCS = (FIXTURES / "sglang" / "production-metrics-docs.txt").read_text()
TRITON_README = (FIXTURES / "triton" / "tensorrtllm-backend-readme.txt").read_text()


def test_sglang_docs_page() -> None:
    metrics = engine_adapter("sglang").parse(SGLANG_DOCS)
    assert metrics == PodMetrics(
        waiting=2826,
        running=162,
        kv_usage=0.28,
        # No cache size on this page (sglang:cache_config_info, max_total_num_tokens).
        kv_capacity_tokens=None,
        prefix_cache_hits_tokens=None,
        prefix_cache_queries_tokens=8.128902e06,
        tokens_processed=8.128902e06 + 7.557572e06,
        requests_finished=None,
        # sglang:time_to_first_token_seconds_count
        requests_prefilled=11008.0,
    )


def test_a_real_vllm_page_gives_its_prefilled_and_finished_requests() -> None:
    """tests/fixtures/vllm/metrics-load.txt, recorded from a real vLLM with requests
    running: six had a first token (time_to_first_token_seconds_count), two finished."""
    page = (FIXTURES.parent / "vllm" / "metrics-load.txt").read_text()
    metrics = engine_adapter("vllm").parse(page)
    assert metrics.requests_prefilled == 6.0
    assert metrics.requests_finished == 2.0


def test_sglang_capacity_from_max_total_num_tokens() -> None:
    # SGLang's KV pool in tokens, on pages without sglang:cache_config_info (PR 1853's
    # page: `sglang:max_total_num_tokens{name="..."} 570979.0`).
    page = SGLANG_DOCS + (
        "# HELP sglang:max_total_num_tokens Maximum total number of tokens\n"
        "# TYPE sglang:max_total_num_tokens gauge\n"
        'sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 570979.0\n'
    )
    assert engine_adapter("sglang").parse(page).kv_capacity_tokens == 570979


def test_triton_tensorrt_llm_readme_page() -> None:
    metrics = engine_adapter("triton").parse(TRITON_README)
    assert metrics == PodMetrics(
        waiting=1,  # request_type="waiting"
        running=1,  # request_type="scheduled"
        kv_usage=0.4875,  # kv_cache_block_type="fraction"
        kv_capacity_tokens=6239 * 64,  # "max" blocks x "tokens_per"
    )


def _lora(running: str, waiting: str, at: float) -> str:
    return (
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {at!r}\n'
    )


def _vllm_lora_page(lora: str) -> str:
    base = 'engine="0",model_name="tiny-llama"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{base}}} 2.0\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{base}}} 5.0\n"
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        f"{lora}"
    )


def test_vllm_lora_info_newest_series_and_a_repeated_waiting_list() -> None:
    """vLLM 0.30+ writes both lists from one table's keys (vllm/v1/metrics/stats.py
    `update_scheduler_stats`, loggers.py `",".join(...keys())`): every adapter with a request
    running or waiting, in both labels; the value is the time the label set was last
    current, and old label sets stay on the page."""
    now = time.time()
    stale = (
        _lora("", "", now - 900.0)  # idle, long ago
        + _lora("a", "a", now - 600.0)
        + _lora("b,a", "b,a", now - 30.0)
        + _lora("", "", now - 20.0)  # idle again
    )
    current = _lora("a,b", "a,b", now)
    metrics = engine_adapter("vllm").parse(_vllm_lora_page(stale + current))
    assert metrics.lora_running == ("a", "b")
    # The waiting list repeats the running one: it says nothing of what waits.
    assert metrics.lora_waiting is None
    assert metrics.max_lora == 2
    assert metrics.lora_recent == ("a", "b")
    # The newest series wins wherever it is on the page, and an idle newest one is idle.
    idle = engine_adapter("vllm").parse(_vllm_lora_page(current + _lora("", "", now + 1)))
    assert (idle.lora_running, idle.lora_waiting) == ((), ())
    # Lists that differ (vLLM before 0.30) are read as they are.
    older = engine_adapter("vllm").parse(_vllm_lora_page(stale + _lora("a", "b", now)))
    assert (older.lora_running, older.lora_waiting) == (("a",), ("b",))


def test_a_repeated_waiting_list_reaches_the_policy_as_unknown() -> None:
    """The policy's signals say "unknown" (None) for the waiting adapters, which placement
    (policy/adapter_demand.py) reads as "queued if the pod's queue is long", and the
    adapters of the pod are the list once, not twice."""
    now = time.time()
    metrics = engine_adapter("vllm").parse(_vllm_lora_page(_lora("a,b", "a,b", now)))
    store = MetricsStore()
    store.record_success("p", metrics, now=0.0)
    observation = store.observation("p", now=0.0)
    assert observation is not None
    signals = signals_of(observation)
    assert signals is not None
    assert signals.waiting_adapters is None
    assert (signals.adapters, signals.running_adapters) == (("a", "b"), ("a", "b"))
    assert (signals.waiting, signals.running) == (5, 2)


def test_trtllm_serve_capacity_is_blocks_times_tokens_per_block() -> None:
    # The series TensorRT-LLM's MetricsCollector writes (tensorrt_llm/metrics/collector.py),
    # with the stats of NVIDIA/TensorRT-LLM issue 6364 (maxNumBlocks 22955, tokensPerBlock 32).
    labels = '{engine_type="pytorch",model_name="Qwen3-0.6B"}'
    page = (
        f"trtllm_num_requests_running{labels} 1.0\n"
        f"trtllm_num_requests_waiting{labels} 0.0\n"
        f"trtllm_kv_cache_utilization{labels} 0.0001306904813765\n"
        f"trtllm_kv_cache_max_blocks{labels} 22955.0\n"
        f"trtllm_kv_cache_tokens_per_block{labels} 32.0\n"
    )
    metrics = engine_adapter("trtllm").parse(page)
    assert (metrics.running, metrics.waiting) == (1, 0)
    assert metrics.kv_capacity_tokens == 22955 * 32


@pytest.fixture
async def renamed_sglang() -> AsyncIterator[str]:
    """The SGLang docs page served by a real HTTP server, its queue metric renamed (as a
    release that renames it would)."""
    page = SGLANG_DOCS.replace("sglang:num_queue_reqs", "sglang:num_waiting_reqs")
    assert "sglang:num_queue_reqs" not in page

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield str(runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def test_a_renamed_queue_metric_is_read_through_the_config(renamed_sglang: str) -> None:
    pool = (
        "pools:\n- name: s\n  models: [m]\n  engine: sglang\n"
        f"  endpoints: [{{address: 127.0.0.1, port: {renamed_sglang}}}]\n"
    )
    renamed = parse_config(pool + "  metrics:\n    names: {waiting: 'sglang:num_waiting_reqs'}\n")
    plain = parse_config(pool)
    store = MetricsStore()
    async with Scraper(store, interval_s=0.02, seed=1) as scraper:
        scraper.set_targets({"plain": next(iter(scrape_targets(plain).values()))})
        scraper.set_targets(
            {
                "plain": next(iter(scrape_targets(plain).values())),
                "renamed": next(iter(scrape_targets(renamed).values())),
            }
        )

        def read() -> bool:
            renamed_pod = store.observation("renamed", now=time.monotonic())
            plain_pod = store.observation("plain", now=time.monotonic())
            return (
                renamed_pod is not None
                and renamed_pod.metrics is not None
                and plain_pod is not None
                and plain_pod.last_error is not None
            )

        await wait_until(read, limit_s=10.0)
    renamed_pod = store.observation("renamed", now=time.monotonic())
    plain_pod = store.observation("plain", now=time.monotonic())
    assert renamed_pod is not None and renamed_pod.metrics is not None
    assert (renamed_pod.metrics.waiting, renamed_pod.metrics.running) == (2826, 162)
    # Without the config's name, the page is a partial page: never read as an idle pod.
    assert plain_pod is not None and plain_pod.metrics is None
    assert plain_pod.last_error is not None and "sglang:num_queue_reqs" in plain_pod.last_error


async def test_a_trtllm_serve_pool_is_read_in_tokens_from_its_prometheus_page() -> None:
    """A trtllm pool with no metrics_path: scraped at /prometheus/metrics, its KV capacity
    the blocks times the page's block size, through the config, the scraper and a pod."""
    store = MetricsStore()
    async with SimulatedPod("t", flavour=Flavour.TRTLLM_SERVE) as pod:
        port = pod.url.rsplit(":", 1)[1]
        config = parse_config(
            "pools:\n- name: t\n  models: [m]\n  engine: trtllm\n"
            f"  endpoints: [{{address: 127.0.0.1, port: {port}}}]\n"
        )
        (target,) = scrape_targets(config).values()
        assert target.url.endswith("/prometheus/metrics")
        async with Scraper(store, interval_s=0.02, seed=1) as scraper:
            scraper.set_targets({"t": target})

            def read() -> bool:
                observation = store.observation("t", now=time.monotonic())
                return observation is not None and observation.metrics is not None

            await wait_until(read, limit_s=10.0)
    observation = store.observation("t", now=time.monotonic())
    assert observation is not None and observation.metrics is not None
    assert observation.metrics.kv_capacity_tokens == H100.kv_blocks * H100.block_size
