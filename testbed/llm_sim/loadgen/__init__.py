"""The benchmark's load generator: seeded traces, an open-loop replayer and the statistics.

`spec` and `trace` (pure) turn a `TraceSpec` and a seed into the exact same requests every
time; `replay` sends them on schedule through Envoy and measures each one (`process` runs
it in a process of its own); `results` holds the measurements and `stats` (pure) turns
them into the TTFT / TPOT / throughput figures the benchmark compares. Every policy
is measured on the same trace, so differences come from the policy, not the traffic.
"""

from __future__ import annotations

from llm_sim.loadgen.errors import LoadgenError, ReplayFailedError, TraceFormatError
from llm_sim.loadgen.process import run_replay_in_subprocess
from llm_sim.loadgen.replay import (
    DEFAULT_BAND_HEADER,
    SATURATION_THRESHOLD_S,
    SESSION_HEADER,
    HeadersFor,
    replay,
)
from llm_sim.loadgen.results import ErrorKind, ReplayResult, RequestResult
from llm_sim.loadgen.stats import Summary, percentile, summarize
from llm_sim.loadgen.trace import (
    BANDS,
    Band,
    BandMix,
    Burst,
    Constant,
    LogNormal,
    Lora,
    Phase,
    PrefixGroups,
    PromptPart,
    RequestClass,
    Sessions,
    Trace,
    TraceRequest,
    TraceSpec,
    TraceSummary,
    Uniform,
    Users,
    generate_trace,
)

__all__ = [
    "BANDS",
    "Band",
    "BandMix",
    "Burst",
    "Constant",
    "DEFAULT_BAND_HEADER",
    "ErrorKind",
    "HeadersFor",
    "LoadgenError",
    "LogNormal",
    "Lora",
    "Phase",
    "PrefixGroups",
    "PromptPart",
    "ReplayFailedError",
    "ReplayResult",
    "RequestClass",
    "RequestResult",
    "SATURATION_THRESHOLD_S",
    "SESSION_HEADER",
    "Sessions",
    "Summary",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "TraceSpec",
    "TraceSummary",
    "Uniform",
    "Users",
    "generate_trace",
    "percentile",
    "replay",
    "run_replay_in_subprocess",
    "summarize",
]
