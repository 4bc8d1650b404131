"""Metrics pages: vLLM's exact names, labels, format and quirks, and the other flavours."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llm_sim.engine import Engine, EngineRequest
from llm_sim.metrics_text import (
    CONTENT_TYPE_PROMETHEUS,
    Flavour,
    HttpStats,
    content_type,
    render_metrics,
)
from llm_sim.profiles import H100
from llm_sim.stats import TTFT_BUCKETS

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def busy_engine(*, adapters: tuple[str | None, ...] = (None, None, None)) -> tuple[Engine, float]:
    engine = Engine(H100, seed=3)
    for i, adapter in enumerate(adapters):
        words = tuple(f"p{k}" for k in range(40 + i))
        engine.add(
            EngineRequest(
                request_id=f"r{i}", prompt=words, max_tokens=4 + i, adapter=adapter, arrival=0.0
            )
        )
    now = 0.0
    for _ in range(4):  # r0 finishes; r1 and r2 keep running
        now = engine.step(now).end
    return engine, now


def families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def page(engine: Engine, **kwargs: object) -> str:
    options: dict[str, object] = {
        "model_name": MODEL,
        "lora_enabled": True,
        "unix_offset": time.time(),
        "http": None,
        **kwargs,
    }
    return render_metrics(engine, **options)  # type: ignore[arg-type]


def test_vllm_page_has_the_exact_names_and_labels() -> None:
    engine, _ = busy_engine()
    text = page(engine)
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
    ):
        assert parsed[name].type == "gauge", name
    for name in (
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
    ):
        assert parsed[name].type == "counter", name
        assert f"# TYPE {name}_total counter\n" in text
        assert all(s.name == f"{name}_total" for s in parsed[name].samples)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert parsed[name].type == "histogram", name
    state = engine.state()
    for family in parsed.values():
        if not family.name.startswith("vllm:") or family.name in {
            "vllm:cache_config_info",
            "vllm:lora_requests_info",
        }:
            continue
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"

    def value(name: str, **labels: str) -> float:
        for family in parsed.values():
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return float(sample.value)
        raise KeyError(name)

    assert value("vllm:num_requests_running") == state.num_running == 2
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(state.kv_usage)
    assert value("vllm:prefix_cache_queries_total") == state.prefix_cache_queries == 123
    assert value("vllm:prefix_cache_hits_total") == 0
    assert value("vllm:generation_tokens_total") == 12
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:time_to_first_token_seconds_count") == 3
    config = parsed["vllm:cache_config_info"].samples[0]
    assert (config.value, config.labels["block_size"], config.labels["num_gpu_blocks"]) == (
        1.0,
        "16",
        str(H100.kv_blocks),
    )
    assert config.labels["engine"] == "0"


def test_lora_requests_info_is_absent_until_the_first_lora_request() -> None:
    engine, _ = busy_engine()
    text = page(engine)
    assert "# HELP vllm:lora_requests_info Running stats on lora requests.\n" in text
    assert "# TYPE vllm:lora_requests_info gauge\n" in text
    assert families(text)["vllm:lora_requests_info"].samples == []  # type: ignore[attr-defined]
    # A server started without LoRA does not declare the family at all.
    assert "vllm:lora_requests_info" not in page(engine, lora_enabled=False)


def test_lora_requests_info_values_are_timestamps_and_old_label_sets_stay() -> None:
    engine, now = busy_engine(adapters=("sql-lora", "chat-lora", None))
    offset = time.time() - now
    while engine.has_work():
        now = engine.step(now).end
    samples = families(page(engine, unix_offset=offset))["vllm:lora_requests_info"].samples  # type: ignore[attr-defined]
    assert len(samples) >= 2
    for sample in samples:
        assert sample.labels["max_lora"] == str(H100.max_loras)
        assert set(sample.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
        assert abs(sample.value - time.time()) < 60
    running = {s.labels["running_lora_adapters"] for s in samples}
    assert "chat-lora,sql-lora" in running and "" in running
    current = max(samples, key=lambda s: s.value)
    assert current.labels["running_lora_adapters"] == ""  # everything finished


def test_vllm_lines_are_what_prometheus_client_writes() -> None:
    """Build the same families with prometheus_client (which vLLM uses) and compare lines."""
    engine, _ = busy_engine()
    ours = page(engine).splitlines()
    state = engine.state()
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        labels,
        registry=registry,
    )
    running.labels(MODEL, "0").set(state.num_running)
    queries = Counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        labels,
        registry=registry,
    )
    queries.labels(MODEL, "0").inc(state.prefix_cache_queries)
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        labels,
        buckets=TTFT_BUCKETS,
        registry=registry,
    )
    child = ttft.labels(MODEL, "0")
    source = engine.histograms.time_to_first_token
    for bound, count in zip((*source.bounds, float("inf")), source.counts, strict=True):
        for _ in range(count):
            child.observe(bound if bound != float("inf") else 1e9)
    reference = [
        line
        for line in generate_latest(registry).decode().splitlines()
        if "_created" not in line and "_sum" not in line
    ]
    assert all(line in ours for line in reference), set(reference) - set(ours)


def test_a_vllm_page_is_as_heavy_as_a_real_one() -> None:
    engine, _ = busy_engine()
    http = HttpStats()
    for handler in ("/v1/chat/completions", "/v1/completions", "/metrics", "/health", "/v1/models"):
        http.observe(
            handler=handler,
            method="GET",
            status=200,
            duration_s=0.01,
            request_bytes=100,
            response_bytes=1000,
        )
    text = page(engine, http=http)
    lines = text.count("\n")
    # A real vLLM page is ~59 KB and 628 lines; same order of magnitude.
    assert 30_000 <= len(text.encode()) <= 120_000
    assert 350 <= lines <= 1200
    names = families(text)
    assert "python_gc_objects_collected" in names and "process_cpu_seconds" in names
    assert "http_requests" in names and "http_request_duration_highr_seconds" in names
    assert content_type(Flavour.VLLM) == CONTENT_TYPE_PROMETHEUS
    assert CONTENT_TYPE_PROMETHEUS == "text/plain; version=1.0.0; charset=utf-8"


@pytest.mark.parametrize(
    ("flavour", "expected"),
    [
        (
            Flavour.SGLANG,
            {
                "sglang:num_queue_reqs": 1.0,
                "sglang:num_running_reqs": 2.0,
                "sglang:token_usage": None,
            },
        ),
        (
            Flavour.TGI,
            {
                "tgi_queue_size": 1.0,
                "tgi_batch_current_size": 2.0,
                "tgi_batch_current_max_tokens": None,
            },
        ),
        (
            Flavour.TRTLLM_SERVE,
            {
                "trtllm_num_requests_waiting": 1.0,
                "trtllm_num_requests_running": 2.0,
                "trtllm_kv_cache_utilization": None,
                "trtllm_kv_cache_max_blocks": float(H100.kv_blocks),
            },
        ),
    ],
)
def test_other_flavours_use_their_servers_names(
    flavour: Flavour, expected: dict[str, float | None]
) -> None:
    engine = Engine(H100, seed=1)
    for i in range(3):
        words = tuple(f"w{i}-{k}" for k in range(1500))
        engine.add(EngineRequest(request_id=f"r{i}", prompt=words, max_tokens=8, arrival=0.0))
    engine.step(0.0)  # the 2048-token budget admits two of the three prompts
    text = page(engine, flavour=flavour)
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name, value in expected.items():
        assert name in samples, name
        if value is not None:
            assert samples[name].value == value, name
    assert not any(name.startswith("vllm:") for name in samples)


def test_triton_names_and_sglang_cache_config() -> None:
    engine, _ = busy_engine()
    triton = page(engine, flavour=Flavour.TRITON)
    samples = [s for f in text_string_to_metric_families(triton) for s in f.samples]
    by_key = {
        (s.name, s.labels.get("request_type") or s.labels.get("kv_cache_block_type")): s.value
        for s in samples
    }
    assert by_key[("nv_trt_llm_request_metrics", "waiting")] == 0
    assert by_key[("nv_trt_llm_request_metrics", "scheduled")] == 2
    assert by_key[("nv_trt_llm_kv_cache_block_metrics", "max")] == H100.kv_blocks
    assert 0 < by_key[("nv_trt_llm_kv_cache_block_metrics", "fraction")] < 1
    sglang = families(page(engine, flavour=Flavour.SGLANG))
    config = sglang["sglang:cache_config_info"].samples[0]  # type: ignore[attr-defined]
    assert (config.labels["page_size"], config.labels["num_pages"]) == ("16", str(H100.kv_blocks))
    assert content_type(Flavour.TRITON) == content_type(Flavour.TGI) == "text/plain; charset=utf-8"
