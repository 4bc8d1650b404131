"""Pages are distrusted input: whatever a pod serves, reading it raises nothing but the
MetricsError tree, believes nothing outside physical bounds, and costs bounded time."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_sim.metrics_text import Flavour
from xds_server.errors import (
    ImplausibleMetricsError,
    MetricsError,
    MetricsParseError,
    PageTooLargeError,
    ScrapeErrorKind,
)
from xds_server.metrics.engines import (
    MAX_ADAPTER_NAME,
    MAX_ADAPTERS,
    MAX_KV_CAPACITY_TOKENS,
    MAX_LORA_SLOTS,
    MAX_REQUESTS,
    EngineAdapter,
    EngineKind,
    PodMetrics,
    engine_adapter,
)
from xds_server.metrics.exposition import MAX_LABELS, MAX_SAMPLES, parse_samples
from xds_server.metrics.scraper import DEFAULT_MAX_PAGE_BYTES

from .pages import busy_engine, page

ADAPTERS = {kind: engine_adapter(kind) for kind in EngineKind}
# Label names the adapters read, so that generated series can match their filters.
LABELS = [
    "block_size",
    "num_gpu_blocks",
    "page_size",
    "num_pages",
    "max_lora",
    "running_lora_adapters",
    "waiting_lora_adapters",
    "request_type",
    "kv_cache_block_type",
    "engine",
    "model_name",
]
LABEL_VALUES = st.one_of(
    st.sampled_from(
        ["waiting", "scheduled", "fraction", "max", "tokens_per", "16", "None", "", "a,b"]
    ),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.just("9" * 5000),  # past Python's int() digit limit
    st.just("9" * 4000),  # an int too large for a float
    st.text(max_size=8),
)
VALUES = st.one_of(
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e308", "-1e308", "0", "1", "1.0000001", "-0"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**25), max_value=10**25).map(str),
    st.just("1" * 400),  # inf as a float
    st.just("zero"),  # malformed
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@st.composite
def hostile_pages(draw: st.DrawFn) -> str:
    """Lines of the families the adapters read, with labels and values anything may
    serve, mixed with garbage."""
    families = sorted({n for a in ADAPTERS.values() for n in a.families})
    lines = []
    for _ in range(draw(st.integers(min_value=0, max_value=25))):
        if draw(st.integers(0, 9)) == 0:
            lines.append(draw(st.text(max_size=30)))  # garbage, anywhere
            continue
        name = draw(st.sampled_from(families))
        keys = draw(st.lists(st.sampled_from(LABELS), max_size=4, unique=True))
        labels = ",".join(f'{k}="{_escape(draw(LABEL_VALUES))}"' for k in keys)
        lines.append(f"{name}{{{labels}}} {draw(VALUES)}")
    return "\n".join(lines) + draw(st.sampled_from(["", "\n"]))


def _believable(metrics: PodMetrics) -> None:
    """What the policy may rely on of any PodMetrics a page yields."""
    assert 0 <= metrics.waiting <= MAX_REQUESTS and 0 <= metrics.running <= MAX_REQUESTS
    assert metrics.kv_usage is None or 0.0 <= metrics.kv_usage <= 1.0
    assert metrics.kv_capacity_tokens is None or (
        0 <= metrics.kv_capacity_tokens <= MAX_KV_CAPACITY_TOKENS
    )
    assert metrics.max_lora is None or 0 <= metrics.max_lora <= MAX_LORA_SLOTS
    for adapters in (metrics.lora_running, metrics.lora_waiting or (), metrics.lora_recent):
        assert len(adapters) <= MAX_ADAPTERS
        assert all(len(name) <= MAX_ADAPTER_NAME for name in adapters)
    for counter in (metrics.prefix_cache_hits_tokens, metrics.prefix_cache_queries_tokens):
        assert counter is None or (math.isfinite(counter) and counter >= 0)


def _read(adapter: EngineAdapter, text: str) -> PodMetrics | MetricsError:
    started = time.process_time()
    try:
        result: PodMetrics | MetricsError = adapter.parse(text)
    except MetricsError as exc:  # anything else fails the test: a bug, logged as internal
        result = exc
    assert time.process_time() - started < 1.0
    return result


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_pages())
def test_a_hostile_page_raises_only_metrics_errors_and_yields_only_believable_metrics(
    text: str,
) -> None:
    for adapter in ADAPTERS.values():
        result = _read(adapter, text)
        if isinstance(result, PodMetrics):
            _believable(result)
        else:
            assert isinstance(result, MetricsParseError)
            assert result.kind in {
                ScrapeErrorKind.PARSE,
                ScrapeErrorKind.IMPLAUSIBLE,
                ScrapeErrorKind.TOO_LARGE,
            }


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_any_bytes_raise_only_metrics_errors(body: bytes) -> None:
    text = body.decode("utf-8", errors="replace")  # as the scraper decodes a page
    for adapter in ADAPTERS.values():
        result = _read(adapter, text)
        if isinstance(result, PodMetrics):
            _believable(result)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(list(Flavour)), st.data())
def test_a_real_page_with_one_line_tampered_with_is_read_or_refused(
    flavour: Flavour, data: st.DataObject
) -> None:
    text = page(busy_engine(), flavour)
    adapter = ADAPTERS[_ENGINE[flavour]]
    lines = text.split("\n")
    wanted = [i for i, line in enumerate(lines) if re.split(r"[{ ]", line)[0] in adapter.families]
    assert len(wanted) >= 2
    index = data.draw(st.sampled_from(wanted))
    head = lines[index].rsplit(" ", 1)[0]
    lines[index] = f"{head} {data.draw(VALUES)}"
    result = _read(adapter, "\n".join(lines))
    if isinstance(result, PodMetrics):
        _believable(result)


_ENGINE = {
    Flavour.VLLM: EngineKind.VLLM,
    Flavour.SGLANG: EngineKind.SGLANG,
    Flavour.TGI: EngineKind.TGI,
    Flavour.TRITON: EngineKind.TRITON,
    Flavour.TRTLLM_SERVE: EngineKind.TRTLLM,
}

# -- the cost of a page as large as the cap ------------------------------------------------

CAP = DEFAULT_MAX_PAGE_BYTES
HEAD = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


def _fill(line: str, *, head: str = HEAD) -> str:
    return head + line * ((CAP - len(head)) // len(line))


def _one_line(start: str, piece: Callable[[int], str], end: str = "") -> str:
    """HEAD, then one wanted line: `start`, as many pieces (labels, escapes in a value) as
    the cap allows, and `end`."""
    end += "} 1\n"
    size = len(HEAD) + len(start) + len(end)
    pieces: list[str] = []
    while size + len(next_piece := piece(len(pieces))) <= CAP:
        pieces.append(next_piece)
        size += len(next_piece)
    return HEAD + start + "".join(pieces) + end


WORST_CASES: dict[str, Callable[[], str]] = {
    "every line wanted": lambda: _fill("vllm:num_requests_waiting 0\n"),
    "every line wanted, with labels": lambda: _fill(
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0\n'
    ),
    "one line of labels": lambda: _one_line("vllm:cache_config_info{", lambda i: f'a{i}="",'),
    "one value of escapes": lambda: _one_line('vllm:cache_config_info{a="', lambda i: "\\n", '"'),
    "LoRA history": lambda: _fill(
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,chat-lora",'
        'waiting_lora_adapters=""} 1.7e9\n'
    ),
    "blank lines": lambda: _fill("\n"),
    "noise": lambda: _fill("x 1\n"),
    "near misses": lambda: _fill("vllm:num_requests_waitingX 1\n"),
    "leading blanks": lambda: _fill("\n \t"),
}


@pytest.mark.parametrize("shape", list(WORST_CASES))
def test_a_page_at_the_cap_costs_bounded_time_whatever_its_shape(shape: str) -> None:
    text = WORST_CASES[shape]()
    assert CAP - 200 <= len(text.encode()) <= CAP
    started = time.process_time()
    try:
        engine_adapter("vllm").parse(text)
    except MetricsError:
        pass
    # ~10-100 ms here; the bound leaves room for a busy CI machine. Without the parser's
    # caps, "one line of labels" took 220 ms and "one value of escapes" 220 ms.
    assert time.process_time() - started < 1.5, shape


def test_more_samples_than_the_cap_is_a_page_too_large() -> None:
    line = "vllm:num_requests_waiting 0\n"
    assert len(parse_samples(line * MAX_SAMPLES, {"vllm:num_requests_waiting"})) == MAX_SAMPLES
    with pytest.raises(PageTooLargeError) as caught:
        parse_samples(line * (MAX_SAMPLES + 1), {"vllm:num_requests_waiting"})
    assert caught.value.kind is ScrapeErrorKind.TOO_LARGE
    assert caught.value.line == MAX_SAMPLES + 1
    assert "more than 10000 samples of the families read (vllm:num_requests_waiting)" in str(
        caught.value
    )
    assert isinstance(caught.value, MetricsParseError)


def test_more_labels_than_the_cap_is_a_page_too_large() -> None:
    labels = ",".join(f'l{i}="v"' for i in range(MAX_LABELS))
    assert len(parse_samples(f"x{{{labels}}} 1\n", {"x"})[0].labels) == MAX_LABELS
    with pytest.raises(PageTooLargeError, match="more than 40000 labels"):
        parse_samples(f'x{{{labels},extra="v"}} 1\n', {"x"})
    # Over all samples, not per sample.
    half = ",".join(f'l{i}="v"' for i in range(MAX_LABELS // 2 + 1))
    with pytest.raises(PageTooLargeError, match="line 2"):
        parse_samples(f"x{{{half}}} 1\nx{{{half}}} 2\n", {"x"})
    assert parse_samples(f"x{{{half}}} 1\ny{{{half}}} 2\n", {"x"})  # y's are not read


def test_a_page_over_the_caps_is_refused_by_the_adapter_too() -> None:
    text = HEAD + 'vllm:lora_requests_info{max_lora="4"} 1\n' * (MAX_SAMPLES + 1)
    with pytest.raises(PageTooLargeError):
        engine_adapter("vllm").parse(text)


def test_implausible_is_a_parse_error_with_its_own_kind() -> None:
    error = ImplausibleMetricsError("x (waiting)", -1.0, "below 0")
    assert error.kind is ScrapeErrorKind.IMPLAUSIBLE
    assert isinstance(error, MetricsParseError) and isinstance(error, ValueError)
    assert (error.metric, error.value, error.bound, error.line) == (
        "x (waiting)",
        -1.0,
        "below 0",
        None,
    )
