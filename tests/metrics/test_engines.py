"""Engine adapters: every flavour's page to PodMetrics, vLLM's quirks, overrides, errors."""

from __future__ import annotations

import time

import pytest

from llm_sim.metrics_text import Flavour
from llm_sim.profiles import H100
from xds_server.errors import (
    ConfigError,
    ImplausibleMetricsError,
    MetricsParseError,
    ScrapeErrorKind,
)
from xds_server.metrics.engines import (
    MAX_KV_CAPACITY_TOKENS,
    MAX_REQUESTS,
    EngineKind,
    LogicalMetric,
    MetricName,
    PodMetrics,
    engine_adapter,
)
from xds_server.metrics.exposition import Sample

from .pages import ADAPTERS, busy_engine, page

ENGINE_OF = {
    Flavour.VLLM: "vllm",
    Flavour.SGLANG: "sglang",
    Flavour.TGI: "tgi",
    Flavour.TRITON: "triton",
    Flavour.TRTLLM_SERVE: "trtllm",
}
CAPACITY = H100.kv_blocks * H100.block_size


@pytest.mark.parametrize("flavour", list(Flavour), ids=lambda f: f.value)
def test_every_flavour_reads_the_engines_state(flavour: Flavour) -> None:
    engine = busy_engine()
    state = engine.state()
    assert state.num_waiting > 0 and state.num_running > 0 and state.prefix_cache_hits > 0
    metrics = engine_adapter(ENGINE_OF[flavour]).parse(page(engine, flavour))
    assert (metrics.waiting, metrics.running) == (state.num_waiting, state.num_running)
    if flavour is Flavour.TGI:
        # TGI states no KV use or size; its batch's token total is not a capacity.
        assert (metrics.kv_usage, metrics.kv_capacity_tokens) == (None, None)
    else:
        assert metrics.kv_usage == pytest.approx(state.kv_usage)
        # In tokens for every engine: Triton's and trtllm-serve's blocks times their size.
        assert metrics.kv_capacity_tokens == CAPACITY
    if flavour is Flavour.VLLM:
        assert metrics.prefix_cache_hits_tokens == state.prefix_cache_hits
        assert metrics.prefix_cache_queries_tokens == state.prefix_cache_queries
        # The label set written last (largest timestamp) is the current one.
        assert len(state.lora_info) >= 2
        running, waiting, _ = max(state.lora_info, key=lambda info: info[2])
        assert metrics.lora_running == tuple(running.split(",")) == tuple(sorted(ADAPTERS))
        assert metrics.lora_waiting == tuple(filter(None, waiting.split(",")))
        assert metrics.max_lora == H100.max_loras
    elif flavour is Flavour.SGLANG:
        assert metrics.prefix_cache_hits_tokens == state.prefix_cache_hits
        assert metrics.prefix_cache_queries_tokens == state.prompt_tokens_total
    else:
        assert metrics.prefix_cache_hits_tokens is None
        assert metrics.prefix_cache_queries_tokens is None
    # The engine's progress: tokens prefilled and generated (vLLM, SGLang only).
    progress = state.prompt_tokens_total + state.generation_tokens_total
    assert state.generation_tokens_total > 0
    expected_progress = progress if flavour in (Flavour.VLLM, Flavour.SGLANG) else None
    assert metrics.tokens_processed == expected_progress
    # Finished requests (vLLM, SGLang, trtllm-serve; TGI and Triton are not read).
    finished = sum(state.finished.values())
    if flavour in (Flavour.VLLM, Flavour.SGLANG):
        assert finished > 0 and metrics.requests_finished == finished
    elif flavour is Flavour.TRTLLM_SERVE:
        assert metrics.requests_finished is not None
    else:
        assert metrics.requests_finished is None
    # Prefilled requests, the time-to-first-token histogram's count (vLLM, SGLang).
    if flavour in (Flavour.VLLM, Flavour.SGLANG):
        assert metrics.requests_prefilled == engine.histograms.time_to_first_token.count > 0
    else:
        assert metrics.requests_prefilled is None
    if flavour is not Flavour.VLLM:
        assert (metrics.lora_running, metrics.lora_waiting, metrics.max_lora) == ((), (), None)


def _vllm(*, lora: str = "", kv: str | None = None, extra: str = "") -> str:
    base = 'engine="0",model_name="m"'
    kv_line = f"vllm:kv_cache_usage_perc{{{base}}} 0.25\n" if kv is None else kv
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{base}}} 3.0\n"
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{base}}} 2.0\n"
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
        f"{kv_line}"
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        f"{lora}"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        f"{extra}"
    )


def _lora(running: str, waiting: str, at: float, max_lora: str = "4") -> str:
    return (
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {at:.9e}\n'
    )


def test_vllm_sums_series_across_engines_and_models() -> None:
    metrics = engine_adapter("vllm").parse(_vllm())
    assert metrics == PodMetrics(
        waiting=3,
        running=7,
        kv_usage=0.25,
        kv_capacity_tokens=1600,
        lora_running=(),
        lora_waiting=(),
        max_lora=None,
        prefix_cache_hits_tokens=None,
        prefix_cache_queries_tokens=None,
    )


def test_vllm_lora_info_absent_until_the_first_lora_request_means_no_adapters() -> None:
    metrics = engine_adapter("vllm").parse(_vllm(lora=""))
    assert (metrics.lora_running, metrics.lora_waiting, metrics.max_lora) == ((), (), None)


def test_vllm_lora_info_the_largest_timestamp_wins_and_old_label_sets_are_ignored() -> None:
    now = time.time()
    lora = (
        _lora("b,a", "c", now - 5)
        + _lora("", "", now)  # the current state: nothing loaded
        + _lora("a", "", now - 60)
        + _lora("x,y,z", "w", now - 3600)
    )
    metrics = engine_adapter("vllm").parse(_vllm(lora=lora))
    assert (metrics.lora_running, metrics.lora_waiting, metrics.max_lora) == ((), (), 4)
    lora = _lora("a", "", now - 60) + _lora("b, a,", "c", now - 1) + _lora("", "", now - 2)
    metrics = engine_adapter("vllm").parse(_vllm(lora=lora))
    assert (metrics.lora_running, metrics.lora_waiting) == (("b", "a"), ("c",))
    bad_max = _lora("a", "", now, max_lora="None")
    assert engine_adapter("vllm").parse(_vllm(lora=bad_max)).max_lora is None


def test_vllm_lora_history_says_which_adapters_an_idle_pod_likely_holds() -> None:
    now = 1.7e9
    # Idle now; before that it ran b and a, then d, then c: its 2 slots hold the last two.
    lora = (
        _lora("", "", now, max_lora="2")
        + _lora("b,a", "", now - 5, max_lora="2")
        + _lora("d", "", now - 60, max_lora="2")
        + _lora("c", "d", now - 90, max_lora="2")
    )
    metrics = engine_adapter("vllm").parse(_vllm(lora=lora))
    assert metrics.lora_running == ()
    assert metrics.lora_recent == ("b", "a")
    unlimited = _lora("c", "", now - 90, max_lora="x") + _lora("d", "", now, max_lora="x")
    assert engine_adapter("vllm").parse(_vllm(lora=unlimited)).lora_recent == ("d", "c")


def test_vllm_falls_back_to_the_older_gpu_cache_usage_name() -> None:
    old = 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    assert engine_adapter("vllm").parse(_vllm(kv=old)).kv_usage == 0.5
    both = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n' + old
    assert engine_adapter("vllm").parse(_vllm(kv=both)).kv_usage == 0.25
    assert engine_adapter("vllm").parse(_vllm(kv="")).kv_usage is None


def test_vllm_older_prefix_cache_counter_names() -> None:
    extra = (
        'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 40.0\n'
    )
    metrics = engine_adapter("vllm").parse(_vllm(extra=extra))
    assert (metrics.prefix_cache_hits_tokens, metrics.prefix_cache_queries_tokens) == (40, 100)


def test_odd_values_are_tamed_or_refused() -> None:
    # Within 1% above 1 is rounding: clamped. "None" for the cache size: unknown.
    over = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.005\n'
    assert engine_adapter("vllm").parse(_vllm(kv=over)).kv_usage == 1.0
    unknown_blocks = _vllm().replace('num_gpu_blocks="100"', 'num_gpu_blocks="None"')
    assert engine_adapter("vllm").parse(unknown_blocks).kv_capacity_tokens is None
    for bad in ("NaN", "-5.0", "+Inf"):
        text = _vllm().replace(
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {bad}',
        )
        with pytest.raises(ImplausibleMetricsError, match="not a request count") as caught:
            engine_adapter("vllm").parse(text)
        assert caught.value.metric == "vllm:num_requests_waiting (waiting)"
        assert caught.value.kind is ScrapeErrorKind.IMPLAUSIBLE
        assert isinstance(caught.value, MetricsParseError)  # a bad page, like a malformed one


def _waiting(value: str) -> str:
    return _vllm().replace(
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0',
        f'vllm:num_requests_waiting{{engine="1",model_name="m"}} {value}',
    )


@pytest.mark.parametrize(
    ("text", "metric", "value", "bound"),
    [
        # A pod that says NaN KV use would be scored as one with room to spare.
        (
            _vllm(kv='vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN\n'),
            "vllm:kv_cache_usage_perc (kv_usage)",
            "nan",
            "not a share of the KV cache",
        ),
        (
            _vllm(kv='vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.5\n'),
            "vllm:kv_cache_usage_perc (kv_usage)",
            "1.5",
            "above 1",
        ),
        (
            _vllm(kv='vllm:kv_cache_usage_perc{engine="0",model_name="m"} -0.2\n'),
            "vllm:kv_cache_usage_perc (kv_usage)",
            "-0.2",
            "below 0",
        ),
        (
            _waiting("99999.0"),  # 100,001 with the other engine's 2
            "vllm:num_requests_waiting (waiting)",
            "100001",
            "above the bound of 100000 requests per pod",
        ),
        (_waiting("1e308"), "vllm:num_requests_waiting (waiting)", "1e+308", "above the bound"),
        (
            # The pod that took 763 of 767 requests.
            _vllm().replace('num_gpu_blocks="100"', 'num_gpu_blocks="1000000000000"'),
            "vllm:cache_config_info block_size x num_gpu_blocks (kv_capacity)",
            "1.6e+13",
            "above the bound of 4294967296 tokens per pod",
        ),
        (
            _vllm().replace('num_gpu_blocks="100"', 'num_gpu_blocks="-100"'),
            "vllm:cache_config_info block_size x num_gpu_blocks (kv_capacity)",
            "-1600",
            "below 0",
        ),
        (
            _vllm().replace('num_gpu_blocks="100"', f'num_gpu_blocks="{"9" * 4000}"'),
            "vllm:cache_config_info block_size x num_gpu_blocks (kv_capacity)",
            "inf",
            "not a cache size",
        ),
        (
            _vllm(extra='vllm:prefix_cache_hits_total{engine="0",model_name="m"} -1\n'),
            "vllm:prefix_cache_hits_total (prefix_cache_hits)",
            "-1",
            "below 0",
        ),
        (
            _vllm(lora=_lora("a", "", 1.7e9, max_lora="100000")),
            "vllm:lora_requests_info max_lora (LoRA slots)",
            "100000",
            "outside 0..4096",
        ),
        (
            _vllm(lora=_lora(",".join(f"a{i}" for i in range(1025)), "", 1.7e9)),
            "vllm:lora_requests_info (LoRA adapters)",
            "1025",
            "above the bound of 1024 adapters",
        ),
        (
            _vllm(lora=_lora("x" * 300, "", 1.7e9)),
            "vllm:lora_requests_info (LoRA adapter name",
            "300",
            "characters, above the bound of 256",
        ),
    ],
    ids=[
        "nan-kv",
        "kv-over-1",
        "negative-kv",
        "too-many-waiting",
        "huge-waiting",
        "1e12-blocks",
        "negative-blocks",
        "4000-digit-blocks",
        "negative-counter",
        "lora-slots",
        "lora-adapters",
        "lora-name",
    ],
)
def test_values_no_pod_can_have_are_not_believed(
    text: str, metric: str, value: str, bound: str
) -> None:
    with pytest.raises(ImplausibleMetricsError) as caught:
        engine_adapter("vllm").parse(text)
    error = caught.value
    assert error.metric.startswith(metric)
    assert f"{error.value:g}" == value and bound in error.bound
    # The message names all three, for the log line.
    assert str(error) == f"{error.metric} is {value}, {error.bound}: not believed"


def test_physical_bounds_hold_for_every_engine() -> None:
    per_block = 'kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"}'
    triton = page(busy_engine(lora=False), Flavour.TRITON)
    assert f"{per_block} 16\n" in triton
    triton_nan_per_block = triton.replace(f"{per_block} 16\n", f"{per_block} NaN\n")
    with pytest.raises(ImplausibleMetricsError, match="not a block size"):
        engine_adapter("triton").parse(triton_nan_per_block)
    huge = (
        "trtllm_num_requests_waiting 0\ntrtllm_num_requests_running 1\n"
        "trtllm_kv_cache_max_blocks 1e10\n"
    )
    with pytest.raises(ImplausibleMetricsError, match="trtllm_kv_cache_max_blocks"):
        engine_adapter("trtllm").parse(huge)
    sglang = "sglang:num_queue_reqs 0\nsglang:num_running_reqs 1\nsglang:token_usage 2\n"
    with pytest.raises(ImplausibleMetricsError, match="sglang:token_usage"):
        engine_adapter("sglang").parse(sglang)
    tgi = "tgi_queue_size 0\ntgi_batch_current_size 200000\n"
    with pytest.raises(ImplausibleMetricsError, match="tgi_batch_current_size"):
        engine_adapter("tgi").parse(tgi)
    # At the bounds: believed.
    edge = (
        "trtllm_num_requests_waiting 100000\ntrtllm_num_requests_running 0\n"
        "trtllm_kv_cache_max_blocks 268435456\ntrtllm_kv_cache_tokens_per_block 16\n"
    )
    metrics = engine_adapter("trtllm").parse(edge)
    assert (metrics.waiting, metrics.kv_capacity_tokens) == (MAX_REQUESTS, MAX_KV_CAPACITY_TOKENS)


def test_a_partial_page_is_an_error_not_an_idle_pod() -> None:
    text = _vllm()
    no_waiting = "\n".join(
        line for line in text.splitlines() if not line.startswith("vllm:num_requests_waiting")
    )
    with pytest.raises(MetricsParseError) as caught:
        engine_adapter("vllm").parse(no_waiting)
    assert caught.value.line is None
    assert "vllm:num_requests_waiting (waiting, vllm)" in str(caught.value)
    # A page cut off in the middle of a line we read.
    cut = text[: text.index("vllm:num_requests_waiting{") + 30]
    with pytest.raises(MetricsParseError, match="line 6"):
        engine_adapter("vllm").parse(cut)
    # The wrong engine for the pod: nothing it needs is there.
    with pytest.raises(MetricsParseError, match="tgi_queue_size"):
        engine_adapter("tgi").parse(text)
    with pytest.raises(MetricsParseError):
        engine_adapter("triton").parse("")


@pytest.mark.parametrize(
    ("flavour", "engine", "block_size_line"),
    [
        (Flavour.TRITON, "triton", "tokens_per"),
        (Flavour.TRTLLM_SERVE, "trtllm", "tokens_per_block"),
    ],
)
def test_a_block_count_is_never_read_as_tokens(
    flavour: Flavour, engine: str, block_size_line: str
) -> None:
    text = page(busy_engine(lora=False), flavour)
    assert engine_adapter(engine).parse(text).kv_capacity_tokens == CAPACITY
    without = "\n".join(line for line in text.splitlines() if block_size_line not in line)
    assert without != text
    # Blocks of unknown size: the capacity is unknown, not 5,000 "tokens".
    assert engine_adapter(engine).parse(without).kv_capacity_tokens is None
    # A block size from the config: used when the page has none, and over the page's.
    fixed = engine_adapter(engine, tokens_per_block=64)
    assert fixed.parse(without).kv_capacity_tokens == H100.kv_blocks * 64
    assert fixed.parse(text).kv_capacity_tokens == H100.kv_blocks * 64
    # Read as tokens (config): the count as it stands.
    tokens = engine_adapter(engine, capacity_unit="tokens")
    assert tokens.parse(text).kv_capacity_tokens == H100.kv_blocks
    with pytest.raises(ConfigError, match="tokens_per_block"):
        engine_adapter(engine, tokens_per_block=0)


def test_every_name_can_be_overridden() -> None:
    text = (
        "queue_len 5\n"
        'running{pool="a"} 2\nrunning{pool="b"} 9\n'
        'kv{kind="used"} 0.4\nkv{kind="free"} 0.6\n'
        "blocks 10\n"
        "cache_hits_total 7\ncache_queries_total 9\n"
    )
    adapter = engine_adapter(
        EngineKind.TGI,
        overrides={
            "waiting": "queue_len",
            LogicalMetric.RUNNING: MetricName("running", {"pool": "a"}),
            "kv_usage": [MetricName("kv_perc"), MetricName("kv", {"kind": "used"})],
            "kv_capacity": "blocks",
            "kv_tokens_per_block": "absent_name",
            "prefix_cache_hits": "cache_hits_total",
            "prefix_cache_queries": "cache_queries_total",
        },
    )
    assert adapter.parse(text) == PodMetrics(
        waiting=5,
        running=2,
        kv_usage=0.4,
        kv_capacity_tokens=10,
        prefix_cache_hits_tokens=7,
        prefix_cache_queries_tokens=9,
    )
    assert "kv_perc" in adapter.families and "kv" in adapter.families
    # Disabling a metric: vLLM without LoRA info.
    now = time.time()
    quiet = engine_adapter("vllm", overrides={"lora_info": []})
    assert quiet.parse(_vllm(lora=_lora("a", "", now))).lora_running == ()
    assert LogicalMetric.LORA_INFO not in quiet.names


def test_read_takes_samples_already_parsed() -> None:
    samples = [
        Sample("trtllm_num_requests_waiting", {}, 1.0),
        Sample("trtllm_num_requests_running", {}, 2.0),
        Sample("trtllm_kv_cache_utilization", {}, 0.5),
    ]
    assert engine_adapter("trtllm-serve").read(samples) == PodMetrics(
        waiting=1, running=2, kv_usage=0.5
    )


@pytest.mark.parametrize(
    ("engine", "overrides", "message"),
    [
        ("llama.cpp", None, "Unknown engine 'llama.cpp'; known engines: vllm, sglang"),
        ("vllm", {"queue": "q"}, "Unknown logical metric 'queue'; known: waiting, running"),
        ("vllm", {"running": []}, "The running metric is required"),
        ("vllm", {"waiting": ""}, "must not be empty"),
    ],
)
def test_bad_adapter_config_is_a_config_error(
    engine: str, overrides: dict[str, object] | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_adapter(engine, overrides=overrides)  # type: ignore[arg-type]


def test_metric_names_are_values() -> None:
    a = MetricName("x", {"k": "v"})
    assert a == MetricName("x", {"k": "v"}) and hash(a) == hash(MetricName("x", {"k": "v"}))
    assert a != MetricName("x")
    with pytest.raises(TypeError):
        a.labels["k"] = "w"  # type: ignore[index]
