"""Per-engine adapters: one model server's metrics page -> one `PodMetrics`.

Every engine says the same few things under different names (DESIGN.md, "Model servers"):
how many requests wait and run, how full the KV cache is and how big, which LoRA adapters
are loaded, and how often the prefix cache hits. An adapter is a table from those logical
metrics (`LogicalMetric`) to where each engine writes them (`MetricName`: a sample name and
an optional label filter), plus a few reading rules that hold for every engine:

- waiting and running are REQUIRED and summed over every matching series. vLLM labels every
  series with `model_name` and `engine` (one series per data-parallel engine; LoRA requests
  are counted under the base model), so the sum is the pod's. A page without them is a
  partial page: `MetricsParseError`, never zeros, or a broken pod would look idle.
- KV usage is the mean over matching series; absent -> None.
- KV capacity, always in tokens: an info series carrying the engine's size labels (vLLM
  `block_size` x `num_gpu_blocks`, SGLang `page_size` x `num_pages`) gives their product;
  any other series gives its value, in the engine's capacity unit (`CapacityUnit`). A
  count of blocks (Triton's `kv_cache_block_type="max"`, trtllm-serve's
  `trtllm_kv_cache_max_blocks`) is multiplied by the block size: the adapter's fixed
  `tokens_per_block` when set (config), else the engine's tokens-per-block series
  (`tokens_per`, `trtllm_kv_cache_tokens_per_block`); with neither, the capacity is unknown
  (None), never a block count read as tokens (pods of one pool are weighed against each
  other by it). A size label that is not an integer (vLLM writes "None") gives None. TGI
  states no cache size: `tgi_batch_current_max_tokens` is the running batch's token total,
  which grows with the load, so it is not read (a busier pod would look bigger).
- LoRA (vLLM `vllm:lora_requests_info`): the value is the Unix time the label set was last
  true and old label sets are never removed, so the current state is the series with the
  LARGEST value; adapters are comma-separated (an empty string is none). The family is
  HELP/TYPE only until the first LoRA request: no series means no adapters, not an error.
  From vLLM 0.30 the two lists are the same set (both are the keys of one per-adapter
  table: every adapter with a request running or waiting, `vllm/v1/metrics/stats.py`), so
  a waiting list equal to the running list says nothing of what waits: `lora_waiting` is
  then None (unknown), not a copy of the running list.
- Prefix-cache hits and queries are cumulative token counters (summed), or None when the
  engine does not export them; `store` turns them into a rate.

Nothing on a page is taken on trust: a pod's page decides how much traffic it gets, and a
pod that claimed a 10^12-block KV cache once took 763 of 767 requests. Values no pod can
have raise `ImplausibleMetricsError`, naming the sample, the value and the bound, and the
page is then a failed scrape (the pod's last good metrics age out; a pod never read is
not in rotation: policy/scoring.py):

- any NaN, infinite or negative count, usage, capacity or counter (NaN KV usage would
  otherwise read as "unknown", which the policy scores as a cache with room to spare);
- waiting or running above `MAX_REQUESTS` (100,000 per pod: vLLM runs at most
  `max_num_seqs`, 256-1024, and Envoy's circuit breakers stop far below that);
- KV usage above 1 by more than `KV_USAGE_SLACK` (1%, rounding; within it, clamped to 1);
- a KV capacity above `MAX_KV_CAPACITY_TOKENS` (2^32 tokens, 30 times what 8 GPUs of
  192 GB hold of even a small model's cache: 1.5 TB at 12 KB per token is 1.3e8);
  a capacity within it but far beyond the pod's peers' is the scraper's check
  (sources/pod_metrics.py), which knows the peers;
- LoRA slots (`max_lora`) above `MAX_LORA_SLOTS`, more than `MAX_ADAPTERS` adapters in a
  running or waiting list, or an adapter name longer than `MAX_ADAPTER_NAME` characters
  (adapter names become endpoint metadata in Envoy).

Several candidates may stand for one logical metric (vLLM's `vllm:kv_cache_usage_perc`, and
`vllm:gpu_cache_usage_perc` on older servers): the first present on the page wins. Only the
first candidates are looked for at first; a fallback costs a second scan of the page only
when its primary is absent. Every name, the capacity unit and the block size can be
overridden per target (`engine_adapter`; the routing config's `metrics` and
`engine_metrics`), so that a pool can follow an engine release that renames a metric.

Pure: text in, frozen value out.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from xds_server.errors import ConfigError, ImplausibleMetricsError, MetricsParseError
from xds_server.metrics.exposition import Sample, parse_samples

__all__ = [
    "CapacityUnit",
    "EngineAdapter",
    "EngineKind",
    "KV_USAGE_SLACK",
    "LogicalMetric",
    "MAX_ADAPTERS",
    "MAX_ADAPTER_NAME",
    "MAX_KV_CAPACITY_TOKENS",
    "MAX_LORA_SLOTS",
    "MAX_REQUESTS",
    "MetricName",
    "Overrides",
    "PodMetrics",
    "engine_adapter",
]

# The physical bounds of a page (see the module docstring).
MAX_REQUESTS = 100_000
MAX_KV_CAPACITY_TOKENS = 1 << 32
KV_USAGE_SLACK = 0.01
MAX_LORA_SLOTS = 4096
MAX_ADAPTERS = 1024
MAX_ADAPTER_NAME = 256


class EngineKind(enum.StrEnum):
    """The model servers whose metric names are known."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"
    TRITON = "triton"  # Triton Inference Server, TensorRT-LLM backend
    TRTLLM = "trtllm"  # trtllm-serve


class LogicalMetric(enum.StrEnum):
    """What the control plane wants to know, whatever the engine calls it."""

    WAITING = "waiting"
    RUNNING = "running"
    KV_USAGE = "kv_usage"
    KV_CAPACITY = "kv_capacity"
    KV_TOKENS_PER_BLOCK = "kv_tokens_per_block"
    LORA_INFO = "lora_info"
    PREFIX_CACHE_HITS = "prefix_cache_hits"
    PREFIX_CACHE_QUERIES = "prefix_cache_queries"
    PROMPT_TOKENS = "prompt_tokens"
    GENERATION_TOKENS = "generation_tokens"
    REQUESTS_FINISHED = "requests_finished"
    REQUESTS_PREFILLED = "requests_prefilled"


CapacityUnit = Literal["tokens", "blocks"]
"""What an engine's KV capacity series counts (an info series' size labels are tokens)."""

_REQUIRED = (LogicalMetric.WAITING, LogicalMetric.RUNNING)
_EMPTY_LABELS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class MetricName:
    """Where a logical metric is on a page: the sample name as written (a counter's with its
    `_total`) and the labels a series must carry to count (all of them, exactly)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY_LABELS)

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("A metric name must not be empty.")
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))

    def __hash__(self) -> int:
        return hash((self.name, frozenset(self.labels.items())))

    def matches(self, sample: Sample) -> bool:
        """Whether `sample` is one of this metric's series (its name already checked)."""
        labels = sample.labels
        return all(labels.get(key) == value for key, value in self.labels.items())


Overrides = Mapping[LogicalMetric | str, MetricName | str | Sequence[MetricName | str]]
"""Per-target names: a logical metric (or its string value) -> a name, or candidates in order
of preference (an empty sequence: do not read it)."""


@dataclass(frozen=True, kw_only=True)
class PodMetrics:
    """What one scrape says about a pod.

    `kv_usage` is 0..1, None when the engine does not say. `kv_capacity_tokens` is the KV
    cache size in tokens, None when unknown (a count of blocks of unknown size too).
    `max_lora` is None when the page does not say (vLLM says only once a LoRA request was
    seen). `lora_waiting` is None when the engine does not tell waiting adapters from
    running ones (its two lists are the same set). The prefix-cache figures are cumulative
    token counters, None when not exported.
    """

    waiting: int
    running: int
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] | None = ()
    # The adapters the pod ran most recently, newest first, at most `max_lora`: what its
    # LoRA slots most likely hold (vLLM evicts the least recently used), even when idle.
    lora_recent: tuple[str, ...] = ()
    max_lora: int | None = None
    prefix_cache_hits_tokens: float | None = None
    prefix_cache_queries_tokens: float | None = None
    # Tokens the engine prefilled and generated, cumulative (None when not exported): an
    # engine that runs requests and moves neither is stuck, whatever else its page says.
    tokens_processed: float | None = None
    # Requests the engine finished, cumulative (None when not exported): with the prefix
    # cache's hits, the prompt tokens its cache saves per request.
    requests_finished: float | None = None
    # Requests the engine prefilled (gave a first token), cumulative: the count of its
    # time-to-first-token histogram. Counted when the prefix cache's hits are, so it is
    # the better denominator for them (metrics/store.py); None when not exported.
    requests_prefilled: float | None = None


def _n(name: str, **labels: str) -> tuple[MetricName, ...]:
    return (MetricName(name, labels),)


_L = LogicalMetric
_TRITON_REQUESTS = "nv_trt_llm_request_metrics"
_TRITON_KV = "nv_trt_llm_kv_cache_block_metrics"

_DEFAULTS: Mapping[EngineKind, Mapping[LogicalMetric, tuple[MetricName, ...]]] = {
    EngineKind.VLLM: {
        _L.WAITING: _n("vllm:num_requests_waiting"),
        _L.RUNNING: _n("vllm:num_requests_running"),
        _L.KV_USAGE: (
            MetricName("vllm:kv_cache_usage_perc"),
            MetricName("vllm:gpu_cache_usage_perc"),  # before vLLM 0.10
        ),
        _L.KV_CAPACITY: _n("vllm:cache_config_info"),
        _L.LORA_INFO: _n("vllm:lora_requests_info"),
        _L.PREFIX_CACHE_HITS: (
            MetricName("vllm:prefix_cache_hits_total"),
            MetricName("vllm:gpu_prefix_cache_hits_total"),  # the older name
        ),
        _L.PREFIX_CACHE_QUERIES: (
            MetricName("vllm:prefix_cache_queries_total"),
            MetricName("vllm:gpu_prefix_cache_queries_total"),
        ),
        _L.PROMPT_TOKENS: _n("vllm:prompt_tokens_total"),
        _L.GENERATION_TOKENS: _n("vllm:generation_tokens_total"),
        _L.REQUESTS_FINISHED: _n("vllm:request_success_total"),
        _L.REQUESTS_PREFILLED: _n("vllm:time_to_first_token_seconds_count"),
    },
    EngineKind.SGLANG: {
        _L.WAITING: _n("sglang:num_queue_reqs"),
        _L.RUNNING: _n("sglang:num_running_reqs"),
        _L.KV_USAGE: _n("sglang:token_usage"),
        _L.KV_CAPACITY: (
            MetricName("sglang:cache_config_info"),
            # The KV pool in tokens, exported since SGLang's first metrics (v0.3.5).
            MetricName("sglang:max_total_num_tokens"),
        ),
        # Cached prompt tokens out of all prompt tokens: the same ratio as vLLM's pair.
        _L.PREFIX_CACHE_HITS: _n("sglang:cached_tokens_total"),
        _L.PREFIX_CACHE_QUERIES: _n("sglang:prompt_tokens_total"),
        _L.PROMPT_TOKENS: _n("sglang:prompt_tokens_total"),
        _L.GENERATION_TOKENS: _n("sglang:generation_tokens_total"),
        _L.REQUESTS_FINISHED: _n("sglang:num_requests_total"),
        _L.REQUESTS_PREFILLED: _n("sglang:time_to_first_token_seconds_count"),
    },
    # TGI exports no KV-cache use or size (module docstring).
    EngineKind.TGI: {
        _L.WAITING: _n("tgi_queue_size"),
        _L.RUNNING: _n("tgi_batch_current_size"),
    },
    EngineKind.TRITON: {
        _L.WAITING: _n(_TRITON_REQUESTS, request_type="waiting"),
        _L.RUNNING: _n(_TRITON_REQUESTS, request_type="scheduled"),
        _L.KV_USAGE: _n(_TRITON_KV, kv_cache_block_type="fraction"),
        _L.KV_CAPACITY: _n(_TRITON_KV, kv_cache_block_type="max"),
        _L.KV_TOKENS_PER_BLOCK: _n(_TRITON_KV, kv_cache_block_type="tokens_per"),
    },
    EngineKind.TRTLLM: {
        _L.WAITING: _n("trtllm_num_requests_waiting"),
        _L.RUNNING: _n("trtllm_num_requests_running"),
        _L.KV_USAGE: _n("trtllm_kv_cache_utilization"),
        _L.KV_CAPACITY: _n("trtllm_kv_cache_max_blocks"),
        _L.KV_TOKENS_PER_BLOCK: _n("trtllm_kv_cache_tokens_per_block"),
        _L.PROMPT_TOKENS: _n("trtllm_prompt_tokens_total"),
        _L.GENERATION_TOKENS: _n("trtllm_generation_tokens_total"),
        _L.REQUESTS_FINISHED: _n("trtllm_request_success_total"),
    },
}

# Engines whose KV capacity series counts blocks, not tokens.
_BLOCK_CAPACITY = frozenset({EngineKind.TRITON, EngineKind.TRTLLM})

# Labels whose product is the KV capacity in tokens, on an engine's cache-config info series.
_CAPACITY_LABELS: Mapping[EngineKind, tuple[str, str]] = {
    EngineKind.VLLM: ("block_size", "num_gpu_blocks"),
    EngineKind.SGLANG: ("page_size", "num_pages"),
}

_ALIASES = {"trtllm-serve": EngineKind.TRTLLM}


@dataclass(frozen=True, eq=False)
class EngineAdapter:
    """Reads one engine's page. Build with `engine_adapter`; immutable and shareable."""

    engine: EngineKind
    names: Mapping[LogicalMetric, tuple[MetricName, ...]]
    capacity_labels: tuple[str, str] | None = None
    capacity_unit: CapacityUnit = "tokens"
    # Tokens per KV block, fixed (config); None: read from the page when in blocks.
    tokens_per_block: int | None = None

    @functools.cached_property
    def families(self) -> frozenset[str]:
        """Every sample name this adapter may look for (fallbacks included)."""
        return frozenset(c.name for candidates in self.names.values() for c in candidates)

    @functools.cached_property
    def _primary(self) -> frozenset[str]:
        return frozenset(candidates[0].name for candidates in self.names.values() if candidates)

    def parse(self, text: str) -> PodMetrics:
        """The pod's metrics from its page. Raises `MetricsParseError` for a malformed line
        of a family read here, or a page without waiting or running."""
        by_name = _by_name(parse_samples(text, self._primary))
        found = self._find(by_name)
        fallbacks = {
            candidate.name
            for metric, candidates in self.names.items()
            if not found[metric]
            for candidate in candidates[1:]
            if candidate.name not in by_name
        }
        if fallbacks:
            by_name.update(_by_name(parse_samples(text, fallbacks)))
            found = self._find(by_name)
        return self._read(found)

    def read(self, samples: Iterable[Sample]) -> PodMetrics:
        """The pod's metrics from samples already parsed (every family in `families`)."""
        return self._read(self._find(_by_name(samples)))

    def _find(self, by_name: Mapping[str, list[Sample]]) -> dict[LogicalMetric, list[Sample]]:
        return {metric: _series(by_name, names) for metric, names in self.names.items()}

    def _read(self, found: Mapping[LogicalMetric, list[Sample]]) -> PodMetrics:
        none: list[Sample] = []
        lora = found.get(LogicalMetric.LORA_INFO, none)
        lora_running, lora_waiting, max_lora = _lora(lora)
        return PodMetrics(
            waiting=self._count(LogicalMetric.WAITING, found.get(LogicalMetric.WAITING, none)),
            running=self._count(LogicalMetric.RUNNING, found.get(LogicalMetric.RUNNING, none)),
            kv_usage=_usage(found.get(LogicalMetric.KV_USAGE, none)),
            kv_capacity_tokens=self._capacity(
                found.get(LogicalMetric.KV_CAPACITY, none),
                found.get(LogicalMetric.KV_TOKENS_PER_BLOCK, none),
            ),
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            lora_recent=_recent_adapters(lora, max_lora),
            max_lora=max_lora,
            prefix_cache_hits_tokens=_counter(
                LogicalMetric.PREFIX_CACHE_HITS, found.get(LogicalMetric.PREFIX_CACHE_HITS, none)
            ),
            prefix_cache_queries_tokens=_counter(
                LogicalMetric.PREFIX_CACHE_QUERIES,
                found.get(LogicalMetric.PREFIX_CACHE_QUERIES, none),
            ),
            requests_finished=_counter(
                LogicalMetric.REQUESTS_FINISHED, found.get(LogicalMetric.REQUESTS_FINISHED, none)
            ),
            requests_prefilled=_counter(
                LogicalMetric.REQUESTS_PREFILLED,
                found.get(LogicalMetric.REQUESTS_PREFILLED, none),
            ),
            tokens_processed=_sum_known(
                _counter(metric, found.get(metric, none))
                for metric in (LogicalMetric.PROMPT_TOKENS, LogicalMetric.GENERATION_TOKENS)
            ),
        )

    def _count(self, metric: LogicalMetric, found: list[Sample]) -> int:
        if not found:
            wanted = " or ".join(_describe(c) for c in self.names[metric])
            raise MetricsParseError(
                f"the page has no {wanted} ({metric.value}, {self.engine.value}): "
                "a partial page, or the wrong engine for this pod"
            )
        for sample in found:
            _not_negative(sample.value, f"{sample.name} ({metric.value})", "not a request count")
        # Each series at most the bound first: fsum of huge values would overflow.
        big = max(found, key=lambda sample: sample.value)
        total = big.value if big.value > MAX_REQUESTS else math.fsum(s.value for s in found)
        if total > MAX_REQUESTS:
            raise ImplausibleMetricsError(
                f"{found[0].name} ({metric.value})",
                total,
                f"above the bound of {MAX_REQUESTS} requests per pod",
            )
        return round(total)

    def _capacity(self, found: list[Sample], tokens_per_block: list[Sample]) -> int | None:
        if not found:
            return None
        capacity = LogicalMetric.KV_CAPACITY.value
        what = f"{found[0].name} ({capacity})"
        total = 0.0
        labels = self.capacity_labels
        blocks = False
        for sample in found:
            if labels is not None and labels[0] in sample.labels and labels[1] in sample.labels:
                size = _label_product(sample.labels[labels[0]], sample.labels[labels[1]])
                if size is None:
                    return None
                what = f"{sample.name} {labels[0]} x {labels[1]} ({capacity})"
                _not_negative(size, what, "not a cache size")
                total += size
            else:
                _not_negative(sample.value, what, "not a cache size")
                total += sample.value
                blocks = self.capacity_unit == "blocks"
        if blocks:
            # A block holds a token at least: too many blocks are refused, size known or not.
            if not total <= MAX_KV_CAPACITY_TOKENS:
                raise ImplausibleMetricsError(
                    what, total, f"above the bound of {MAX_KV_CAPACITY_TOKENS} tokens per pod"
                )
            block_size = self._block_size(tokens_per_block)
            if block_size is None:
                return None
            total *= block_size
        if not total <= MAX_KV_CAPACITY_TOKENS:  # NaN too: an infinite size x 0 tokens
            raise ImplausibleMetricsError(
                what, total, f"above the bound of {MAX_KV_CAPACITY_TOKENS} tokens per pod"
            )
        return round(total)


    def _block_size(self, tokens_per_block: list[Sample]) -> float | None:
        """Tokens per KV block: the fixed size, else the page's, else None (unknown)."""
        if self.tokens_per_block is not None:
            return float(self.tokens_per_block)
        if not tokens_per_block:
            return None
        for sample in tokens_per_block:
            _not_negative(
                sample.value,
                f"{sample.name} ({LogicalMetric.KV_TOKENS_PER_BLOCK.value})",
                "not a block size",
            )
        return _mean(tokens_per_block)


def engine_adapter(
    engine: EngineKind | str,
    *,
    overrides: Overrides | None = None,
    capacity_unit: CapacityUnit | None = None,
    tokens_per_block: int | None = None,
) -> EngineAdapter:
    """The adapter for `engine` ("vllm", "sglang", "tgi", "triton", "trtllm"; also
    "trtllm-serve"), with `overrides` replacing names per logical metric, `capacity_unit`
    what its KV capacity series counts (None: the engine's own, blocks for Triton and
    trtllm-serve, else tokens) and `tokens_per_block` a fixed block size (None: the page's).

    Raises `ConfigError` naming an unknown engine or logical metric, an override that
    would leave waiting or running unread, or a block size below 1.
    """
    if tokens_per_block is not None and tokens_per_block < 1:
        raise ConfigError(f"tokens_per_block must be 1 or more, not {tokens_per_block}.")
    kind = _engine_kind(engine)
    names = dict(_DEFAULTS[kind])
    for key, value in (overrides or {}).items():
        metric = _logical_metric(key)
        if isinstance(value, MetricName):
            candidates: tuple[MetricName, ...] = (value,)
        elif isinstance(value, str):
            candidates = (MetricName(value),)
        else:
            candidates = tuple(c if isinstance(c, MetricName) else MetricName(c) for c in value)
        if not candidates and metric in _REQUIRED:
            raise ConfigError(f"The {metric.value} metric is required and cannot be disabled.")
        names[metric] = candidates
    return EngineAdapter(
        engine=kind,
        names=MappingProxyType({m: c for m, c in names.items() if c}),
        capacity_labels=_CAPACITY_LABELS.get(kind),
        capacity_unit=capacity_unit or ("blocks" if kind in _BLOCK_CAPACITY else "tokens"),
        tokens_per_block=tokens_per_block,
    )


def _engine_kind(engine: EngineKind | str) -> EngineKind:
    if isinstance(engine, EngineKind):
        return engine
    if engine in _ALIASES:
        return _ALIASES[engine]
    try:
        return EngineKind(engine)
    except ValueError:
        known = ", ".join(kind.value for kind in EngineKind)
        raise ConfigError(f"Unknown engine {engine!r}; known engines: {known}.") from None


def _logical_metric(key: LogicalMetric | str) -> LogicalMetric:
    try:
        return LogicalMetric(key)
    except ValueError:
        known = ", ".join(metric.value for metric in LogicalMetric)
        raise ConfigError(f"Unknown logical metric {key!r}; known: {known}.") from None


def _describe(name: MetricName) -> str:
    if not name.labels:
        return name.name
    return name.name + "{" + ",".join(f'{k}="{v}"' for k, v in name.labels.items()) + "}"


def _by_name(samples: Iterable[Sample]) -> dict[str, list[Sample]]:
    by_name: dict[str, list[Sample]] = {}
    for sample in samples:
        by_name.setdefault(sample.name, []).append(sample)
    return by_name


def _series(by_name: Mapping[str, list[Sample]], candidates: Sequence[MetricName]) -> list[Sample]:
    """The series of the first candidate that has any on the page."""
    for candidate in candidates:
        samples = by_name.get(candidate.name)
        if not samples:
            continue
        if not candidate.labels:
            return samples
        found = [s for s in samples if candidate.matches(s)]
        if found:
            return found
    return []


def _mean(samples: list[Sample]) -> float:
    return sum(s.value for s in samples) / len(samples)  # not fsum: it raises on overflow


def _not_negative(value: float, what: str, meaning: str) -> None:
    """Raise ImplausibleMetricsError unless `value` is a finite number, 0 or more."""
    if math.isnan(value) or math.isinf(value):
        raise ImplausibleMetricsError(what, value, meaning)
    if value < 0:
        raise ImplausibleMetricsError(what, value, f"below 0: {meaning}")


def _usage(samples: list[Sample]) -> float | None:
    if not samples:
        return None
    for sample in samples:
        what = f"{sample.name} ({LogicalMetric.KV_USAGE.value})"
        _not_negative(sample.value, what, "not a share of the KV cache")
        if sample.value > 1 + KV_USAGE_SLACK:
            raise ImplausibleMetricsError(what, sample.value, "above 1: more cache than there is")
    return min(1.0, math.fsum(s.value for s in samples) / len(samples))


def _counter(metric: LogicalMetric, samples: list[Sample]) -> float | None:
    if not samples:
        return None
    for sample in samples:
        _not_negative(sample.value, f"{sample.name} ({metric.value})", "not a token count")
    total = sum(s.value for s in samples)  # not fsum: it raises on overflow
    _not_negative(total, f"{samples[0].name} ({metric.value})", "not a token count")
    return total


def _sum_known(values: Iterable[float | None]) -> float | None:
    """The sum of the values that are known, None when none is."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _label_product(first: str, second: str) -> float | None:
    """The product of two integer label values (vLLM: "16" x "5000"), None if either is not
    an integer (vLLM writes "None" for a cache size it does not know). Integers too large
    for a float are infinite (and not believed by the caller)."""
    try:
        product = int(first) * int(second)
    except ValueError:
        return None
    return _as_float(product)


def _as_float(number: int) -> float:
    """`number` as a float, infinite if too large for one (`float` would raise)."""
    if abs(number) < 10**300:
        return float(number)
    return math.inf if number > 0 else -math.inf


def _lora(
    samples: list[Sample],
) -> tuple[tuple[str, ...], tuple[str, ...] | None, int | None]:
    """(running, waiting, max_lora) from the series with the latest timestamp value;
    waiting is None when it repeats the running set (module docstring)."""
    timed = [s for s in samples if not math.isnan(s.value)]
    if not timed:
        return (), (), None
    current = max(timed, key=lambda s: s.value)
    try:
        max_lora: int | None = int(current.labels.get("max_lora", ""))
    except ValueError:
        max_lora = None
    if max_lora is not None and not 0 <= max_lora <= MAX_LORA_SLOTS:
        raise ImplausibleMetricsError(
            f"{current.name} max_lora (LoRA slots)",
            _as_float(max_lora),
            f"outside 0..{MAX_LORA_SLOTS}",
        )
    running = _adapters(current.labels.get("running_lora_adapters", ""), current.name)
    waiting = _adapters(current.labels.get("waiting_lora_adapters", ""), current.name)
    if running and set(waiting) == set(running):
        return running, None, max_lora
    return running, waiting, max_lora


def _recent_adapters(samples: list[Sample], max_lora: int | None) -> tuple[str, ...]:
    """The running adapters of every series, newest series first, each adapter once, at
    most `max_lora` of them (vLLM keeps old label sets: together they are the history)."""
    timed = sorted(
        (s for s in samples if not math.isnan(s.value)), key=lambda s: s.value, reverse=True
    )
    recent: dict[str, None] = {}
    for sample in timed:
        for adapter in _adapters(sample.labels.get("running_lora_adapters", ""), sample.name):
            recent.setdefault(adapter)
    return tuple(recent)[: MAX_ADAPTERS if max_lora is None else max_lora]


def _adapters(listed: str, where: str) -> tuple[str, ...]:
    names = tuple(name for name in (part.strip() for part in listed.split(",")) if name)
    if len(names) > MAX_ADAPTERS:
        raise ImplausibleMetricsError(
            f"{where} (LoRA adapters)", len(names), f"above the bound of {MAX_ADAPTERS} adapters"
        )
    for name in names:
        if len(name) > MAX_ADAPTER_NAME:
            raise ImplausibleMetricsError(
                f"{where} (LoRA adapter name {name[:40]!r}...)",
                len(name),
                f"characters, above the bound of {MAX_ADAPTER_NAME}",
            )
    return names
