"""A simulated engine's `/metrics` page, byte for byte the way each model server writes it.

The control plane's scrapers and parsers are tested and benchmarked against these pages, so
what matters is the format, not only the numbers: vLLM v1 writes through prometheus_client
(HELP and TYPE per family, counters' family lines ending in `_total`, labels in sorted
order, values in Go float notation such as `1.234567e+06`, no `_created` series in its
multiprocess mode), and its quirks are reproduced (DESIGN.md, "Model servers"):

- every `vllm:` series carries `engine="0"` and `model_name` (LoRA requests are counted
  under the base model); `vllm:cache_config_info` carries `engine` and the cache config
  instead, as vLLM's does, and `vllm:lora_requests_info` only its three own labels;
- the prefix-cache counters count tokens;
- `vllm:lora_requests_info` is HELP/TYPE only until the first LoRA request; then its value
  is the Unix time of the last step that saw that (running, waiting) adapter set, and old
  label sets stay, so the current state is the series with the largest value;
- a real page is ~59 KB and ~600 lines, mostly histograms, HTTP-server and Python process
  families; the same families are rendered here (with live numbers) so parsing costs the
  same.

Other flavours render the names their servers use (SGLang, TGI, Triton's TensorRT-LLM
backend, trtllm-serve), so each parser has a page to read. Pure apart from reading this
process's own statistics for the `process_*`/`python_*` noise (cached for a second).
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from llm_sim.engine import Engine, EngineState, FinishReason
from llm_sim.stats import Histogram

__all__ = [
    "CONTENT_TYPE_PROMETHEUS",
    "FILTERABLE",
    "Flavour",
    "HttpStats",
    "content_type",
    "render_metrics",
    "restrict_page",
]

# What prometheus_client >= 0.22 (hence vLLM, SGLang, trtllm-serve) sends.
CONTENT_TYPE_PROMETHEUS = "text/plain; version=1.0.0; charset=utf-8"
# TGI (Rust metrics-exporter-prometheus behind axum) and Triton (prometheus-cpp).
_CONTENT_TYPE_PLAIN = "text/plain; charset=utf-8"

_INF = float("inf")


class Flavour(enum.Enum):
    """Which model server's metric names and format a pod's `/metrics` uses."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"
    TRITON = "triton"
    TRTLLM_SERVE = "trtllm-serve"


# The flavours whose servers write their page with prometheus-client, which honours
# `?name[]=...` (only the series named).
FILTERABLE = frozenset({Flavour.VLLM, Flavour.SGLANG})


def restrict_page(text: str, names: Collection[str]) -> str:
    """`text` with only the samples named in `names` (sample names, a counter's with its
    `_total`) and the HELP and TYPE lines of their families: what prometheus-client
    serves for `/metrics?name[]=...`."""
    wanted = set(names)
    out: list[str] = []
    header: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            follows_help = bool(header) and header[-1].startswith("# HELP")
            if line.startswith("# HELP") or not follows_help:
                header = []
            header.append(line)
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out.extend(header)
            header = []
            out.append(line)
    return "\n".join(out) + "\n" if out else ""


def content_type(flavour: Flavour) -> str:
    """The `Content-Type` that flavour's server sends with its metrics page."""
    if flavour in (Flavour.TGI, Flavour.TRITON):
        return _CONTENT_TYPE_PLAIN
    return CONTENT_TYPE_PROMETHEUS


# -- the HTTP-server noise ---------------------------------------------------------------------

# prometheus-fastapi-instrumentator's buckets, as on a vLLM page.
_HIGHR_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0,
    7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
_LOWR_BUCKETS = (0.1, 0.5, 1.0)


@dataclass(frozen=True)
class _HttpKey:
    handler: str
    method: str
    status: str


class HttpStats:
    """Per-handler request counts, sizes and durations, as an HTTP instrumentation library
    exports them (the `http_*` families of a vLLM page).

    Mutable state: `_count`, `_sizes`, `_durations`, `_highr`.
    """

    def __init__(self) -> None:
        self._count: dict[_HttpKey, int] = {}
        self._sizes: dict[str, list[float]] = {}  # handler -> [n, request bytes, response bytes]
        self._durations: dict[tuple[str, str], Histogram] = {}
        self._highr = Histogram(_HIGHR_BUCKETS)

    def observe(
        self,
        *,
        handler: str,
        method: str,
        status: int,
        duration_s: float,
        request_bytes: int,
        response_bytes: int,
    ) -> None:
        key = _HttpKey(handler, method, f"{status // 100}xx")
        self._count[key] = self._count.get(key, 0) + 1
        sizes = self._sizes.setdefault(handler, [0.0, 0.0, 0.0])
        sizes[0] += 1
        sizes[1] += request_bytes
        sizes[2] += response_bytes
        durations = self._durations.get((handler, method))
        if durations is None:
            durations = self._durations[(handler, method)] = Histogram(_LOWR_BUCKETS)
        durations.observe(duration_s)
        self._highr.observe(duration_s)


# -- rendering ---------------------------------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _value(value: float) -> str:
    """A sample value as prometheus_client writes it (Go's float formatting: `12000.0`,
    `1.234567e+06`, `+Inf`)."""
    value = float(value)
    if value.is_integer() and 0 <= value < 1e6:  # the common case, fast
        return f"{int(value)}.0"
    if value == _INF:
        return "+Inf"
    if value == -_INF:
        return "-Inf"
    if value != value:
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    # Go switches to exponents sooner than Python (prometheus_client.utils.floatToGoString).
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


class _Page:
    """Accumulates exposition lines in prometheus_client's text format."""

    def __init__(self, *, help_lines: bool = True, integer_values: bool = False) -> None:
        self.lines: list[str] = []
        self._help = help_lines
        self._integers = integer_values

    def _v(self, value: float) -> str:
        if self._integers and float(value).is_integer():
            return str(int(value))
        return _value(value)

    def family(self, name: str, kind: str, documentation: str) -> None:
        if self._help:
            self.lines.append(f"# HELP {name} {documentation}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {self._v(value)}")

    def gauge(
        self, name: str, documentation: str, samples: Iterable[tuple[Mapping[str, str], float]]
    ) -> None:
        self.family(name, "gauge", documentation)
        for labels, value in samples:
            self.sample(name, labels, value)

    def counter(
        self, name: str, documentation: str, samples: Iterable[tuple[Mapping[str, str], float]]
    ) -> None:
        """`name` without `_total`; the family and sample lines get the suffix."""
        self.family(f"{name}_total", "counter", documentation)
        for labels, value in samples:
            self.sample(f"{name}_total", labels, value)

    def histogram(
        self, name: str, documentation: str, series: Iterable[tuple[Mapping[str, str], Histogram]]
    ) -> None:
        self.family(name, "histogram", documentation)
        for labels, histogram in series:
            # `le` sorts among the other labels; render the parts around it once.
            ordered = sorted(labels.items())
            before = "".join(f'{k}="{_escape(v)}",' for k, v in ordered if k < "le")
            after = "".join(f',{k}="{_escape(v)}"' for k, v in ordered if k > "le")
            bucket = f"{name}_bucket{{{before}le="
            self.lines.extend(
                f'{bucket}"{le}"{after}}} {self._v(count)}'
                for le, (_, count) in zip(
                    _le_labels(histogram.bounds), histogram.cumulative(), strict=True
                )
            )
            self.sample(f"{name}_count", labels, histogram.count)
            self.sample(f"{name}_sum", labels, histogram.sum)

    def summary(
        self,
        name: str,
        documentation: str,
        series: Iterable[tuple[Mapping[str, str], float, float]],
    ) -> None:
        self.family(name, "summary", documentation)
        for labels, count, total in series:
            self.sample(f"{name}_count", labels, count)
            self.sample(f"{name}_sum", labels, total)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@functools.cache
def _le_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    return (*(_value(b) for b in bounds), "+Inf")


_process_cache: tuple[float, str] = (-1.0, "")


def _process_text() -> str:
    """This process's `python_gc_*`, `python_info` and `process_*` families, refreshed once a
    second (every pod in the process shares them, as pods in one process would)."""
    global _process_cache
    now = time.monotonic()
    if now - _process_cache[0] < 1.0:
        return _process_cache[1]
    registry = CollectorRegistry()
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    ProcessCollector(registry=registry)
    text = bytes(generate_latest(registry)).decode()
    _process_cache = (now, text)
    return text


def _http_families(page: _Page, http: HttpStats) -> None:
    page.counter(
        "http_requests",
        "Total number of requests by method, status and handler.",
        (
            ({"handler": k.handler, "method": k.method, "status": k.status}, n)
            for k, n in sorted(http._count.items(), key=lambda kv: (kv[0].handler, kv[0].status))
        ),
    )
    page.summary(
        "http_request_size_bytes",
        "Content length of incoming requests by handler. Only value of header is respected. "
        "Otherwise ignored. No percentile calculated. ",
        (({"handler": h}, s[0], s[1]) for h, s in sorted(http._sizes.items())),
    )
    page.summary(
        "http_response_size_bytes",
        "Content length of outgoing responses by handler. Only value of header is respected. "
        "Otherwise ignored. No percentile calculated. ",
        (({"handler": h}, s[0], s[2]) for h, s in sorted(http._sizes.items())),
    )
    page.histogram(
        "http_request_duration_highr_seconds",
        "Latency with many buckets but no API specific labels. Made for more accurate "
        "percentile calculations. ",
        [({}, http._highr)],
    )
    page.histogram(
        "http_request_duration_seconds",
        "Latency with only few buckets by handler. Made to be only used if aggregation by "
        "handler is important. ",
        (
            ({"handler": handler, "method": method}, histogram)
            for (handler, method), histogram in sorted(http._durations.items())
        ),
    )


def render_metrics(
    engine: Engine,
    *,
    flavour: Flavour = Flavour.VLLM,
    model_name: str,
    lora_enabled: bool,
    unix_offset: float,
    http: HttpStats | None = None,
    kv_claim: float = 1.0,
) -> str:
    """The engine's metrics page as `flavour`'s server would serve it.

    `kv_claim` makes a vLLM page lie about its KV cache: `kv_claim` times the blocks it
    has, and its use of them divided by as much (a misconfigured or hostile pod).

    `unix_offset` converts engine time to Unix time (`unix = engine time + offset`), for
    `vllm:lora_requests_info`'s timestamp values. `lora_enabled` says whether the server
    was started with LoRA (vLLM only declares `vllm:lora_requests_info` then). `http`
    supplies the HTTP-server families; without it they are omitted.
    """
    state = engine.state()
    if flavour is Flavour.VLLM:
        return _vllm(engine, state, model_name, lora_enabled, unix_offset, http, kv_claim)
    if flavour is Flavour.SGLANG:
        return _sglang(engine, state, model_name)
    if flavour is Flavour.TGI:
        return _tgi(engine, state)
    if flavour is Flavour.TRITON:
        return _triton(engine, state)
    return _trtllm_serve(engine, state, model_name)


def _vllm(
    engine: Engine,
    state: EngineState,
    model_name: str,
    lora_enabled: bool,
    unix_offset: float,
    http: HttpStats | None,
    kv_claim: float = 1.0,
) -> str:
    profile = engine.profile
    h = engine.histograms
    base = {"engine": "0", "model_name": model_name}
    page = _Page()
    page.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        [(base, state.num_running)],
    )
    page.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        [(base, state.num_waiting)],
    )
    page.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        [(base, state.kv_usage / kv_claim)],
    )
    page.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        [(base, state.prefix_cache_queries)],
    )
    page.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        [(base, state.prefix_cache_hits)],
    )
    page.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        [(base, state.preemptions)],
    )
    page.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        [(base, state.prompt_tokens_total)],
    )
    page.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        [(base, state.generation_tokens_total)],
    )
    page.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [({**base, "finished_reason": r.value}, state.finished[r]) for r in FinishReason],
    )
    histograms: Sequence[tuple[str, str, Histogram]] = (
        (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            h.request_prompt_tokens,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            h.request_generation_tokens,
        ),
        (
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            h.iteration_tokens,
        ),
        (
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            h.request_max_num_generation_tokens,
        ),
        ("vllm:request_params_n", "Histogram of the n request parameter.", h.request_params_n),
        (
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            h.request_params_max_tokens,
        ),
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            h.time_to_first_token,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            h.inter_token_latency,
        ),
        (
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            h.request_time_per_output_token,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            h.e2e_request_latency,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            h.request_queue_time,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            h.request_inference_time,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            h.request_prefill_time,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            h.request_decode_time,
        ),
    )
    for name, documentation, histogram in histograms:
        page.histogram(name, documentation, [(base, histogram)])
    if lora_enabled:
        page.gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            (
                (
                    {
                        "max_lora": str(profile.max_loras),
                        "running_lora_adapters": running,
                        "waiting_lora_adapters": waiting,
                    },
                    at + unix_offset,
                )
                for running, waiting, at in state.lora_info
            ),
        )
    page.gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        [(_vllm_cache_config(profile.block_size, round(profile.kv_blocks * kv_claim)), 1.0)],
    )
    if http is not None:
        _http_families(page, http)
    return _process_text() + page.text()


def _vllm_cache_config(block_size: int, blocks: int) -> dict[str, str]:
    """`vllm:cache_config_info`'s labels as vLLM 0.32 writes them (a real page's set:
    tests/fixtures/vllm/), with this pod's cache size."""
    tokens = block_size * blocks
    return {
        "_block_size_resolved": "True",
        "block_size": str(block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.9",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": "None",
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "False",
    }


def _sglang(engine: Engine, state: EngineState, model_name: str) -> str:
    h = engine.histograms
    base = {"model_name": model_name}
    profile = engine.profile
    used_tokens = state.kv_blocks_used * profile.block_size
    hit_rate = (
        state.prefix_cache_hits / state.prefix_cache_queries if state.prefix_cache_queries else 0.0
    )
    page = _Page()
    page.gauge(
        "sglang:num_running_reqs", "The number of running requests.", [(base, state.num_running)]
    )
    page.gauge("sglang:num_used_tokens", "The number of used tokens.", [(base, used_tokens)])
    page.gauge("sglang:token_usage", "The token usage.", [(base, state.kv_usage)])
    page.gauge(
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        [(base, state.num_waiting)],
    )
    page.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", [(base, hit_rate)])
    page.gauge(
        "sglang:cache_config_info",
        "Information of the cache config.",
        [
            (
                {**base, "num_pages": str(profile.kv_blocks), "page_size": str(profile.block_size)},
                1.0,
            )
        ],
    )
    page.counter(
        "sglang:prompt_tokens",
        "Number of prefill tokens processed.",
        [(base, state.prompt_tokens_total)],
    )
    page.counter(
        "sglang:generation_tokens",
        "Number of generation tokens processed.",
        [(base, state.generation_tokens_total)],
    )
    page.counter(
        "sglang:cached_tokens", "Number of cached prompt tokens.", [(base, state.prefix_cache_hits)]
    )
    page.counter(
        "sglang:num_requests",
        "Number of requests processed.",
        [(base, sum(state.finished.values()))],
    )
    page.histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        [(base, h.time_to_first_token)],
    )
    page.histogram(
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        [(base, h.inter_token_latency)],
    )
    page.histogram(
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        [(base, h.e2e_request_latency)],
    )
    return _process_text() + page.text()


def _tgi(engine: Engine, state: EngineState) -> str:
    """metrics-exporter-prometheus: TYPE lines only, integer values printed bare."""
    h = engine.histograms
    page = _Page(help_lines=False, integer_values=True)
    batch_max_tokens = state.running_context_tokens + sum(state.running_remaining_tokens)
    page.family("tgi_request_count", "counter", "")
    page.sample(
        "tgi_request_count",
        {},
        sum(state.finished.values()) + state.num_running + state.num_waiting,
    )
    page.family("tgi_request_success", "counter", "")
    page.sample("tgi_request_success", {}, state.finished[FinishReason.LENGTH])
    page.family("tgi_queue_size", "gauge", "")
    page.sample("tgi_queue_size", {}, state.num_waiting)
    page.family("tgi_batch_current_size", "gauge", "")
    page.sample("tgi_batch_current_size", {}, state.num_running)
    page.family("tgi_batch_current_max_tokens", "gauge", "")
    page.sample("tgi_batch_current_max_tokens", {}, batch_max_tokens)
    page.family("tgi_request_generated_tokens", "counter", "")
    page.sample("tgi_request_generated_tokens", {}, state.generation_tokens_total)
    page.histogram("tgi_request_queue_duration", "", [({}, h.request_queue_time)])
    page.histogram("tgi_request_duration", "", [({}, h.e2e_request_latency)])
    page.histogram("tgi_request_input_length", "", [({}, h.request_prompt_tokens)])
    return page.text()


def _triton(engine: Engine, state: EngineState) -> str:
    """prometheus-cpp, as Triton's TensorRT-LLM backend exports it."""
    profile = engine.profile
    base = {"model": "tensorrt_llm", "version": "1"}
    page = _Page(integer_values=True)
    page.gauge(
        "nv_trt_llm_request_metrics",
        "TRT LLM request metrics",
        [
            ({**base, "request_type": "context"}, state.num_prefilling),
            ({**base, "request_type": "scheduled"}, state.num_running),
            ({**base, "request_type": "max"}, profile.max_num_seqs),
            ({**base, "request_type": "active"}, state.num_running + state.num_waiting),
            ({**base, "request_type": "waiting"}, state.num_waiting),
        ],
    )
    page.gauge(
        "nv_trt_llm_kv_cache_block_metrics",
        "TRT LLM KV cache block metrics",
        [
            ({**base, "kv_cache_block_type": "fraction"}, state.kv_usage),
            ({**base, "kv_cache_block_type": "tokens_per"}, profile.block_size),
            ({**base, "kv_cache_block_type": "used"}, state.kv_blocks_used),
            ({**base, "kv_cache_block_type": "free"}, state.kv_blocks - state.kv_blocks_used),
            ({**base, "kv_cache_block_type": "max"}, state.kv_blocks),
        ],
    )
    page.gauge(
        "nv_trt_llm_general_metrics",
        "General TRT LLM metrics",
        [({**base, "general_type": "iteration_counter"}, state.steps)],
    )
    ensemble = {"model": "ensemble", "version": "1"}
    done = sum(state.finished.values())
    page.counter(
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        [(ensemble, done)],
    )
    page.counter(
        "nv_inference_request_failure",
        "Number of failed inference requests, all batch sizes",
        [(ensemble, 0)],
    )
    page.counter(
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        [(ensemble, done)],
    )
    return page.text()


def _trtllm_serve(engine: Engine, state: EngineState, model_name: str) -> str:
    h = engine.histograms
    base = {"engine_type": "trtllm", "model_name": model_name}
    page = _Page()
    page.gauge(
        "trtllm_num_requests_running",
        "Number of requests currently running.",
        [(base, state.num_running)],
    )
    page.gauge(
        "trtllm_num_requests_waiting",
        "Number of requests waiting to be scheduled.",
        [(base, state.num_waiting)],
    )
    page.gauge(
        "trtllm_kv_cache_utilization", "KV cache utilization (0 to 1).", [(base, state.kv_usage)]
    )
    page.gauge(
        "trtllm_kv_cache_max_blocks",
        "Maximum number of KV cache blocks",
        [(base, state.kv_blocks)],
    )
    page.gauge(
        "trtllm_kv_cache_tokens_per_block",
        "Number of tokens per KV cache block",
        [(base, engine.profile.block_size)],
    )
    hit_rate = (
        state.prefix_cache_hits / state.prefix_cache_queries if state.prefix_cache_queries else 0.0
    )
    page.gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate.", [(base, hit_rate)])
    page.counter(
        "trtllm_request_success",
        "Count of successfully processed requests.",
        [({**base, "finished_reason": "length"}, state.finished[FinishReason.LENGTH])],
    )
    page.histogram(
        "trtllm_time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        [(base, h.time_to_first_token)],
    )
    page.histogram(
        "trtllm_e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds.",
        [(base, h.e2e_request_latency)],
    )
    page.histogram(
        "trtllm_request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        [(base, h.request_queue_time)],
    )
    return _process_text() + page.text()
