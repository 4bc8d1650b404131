"""Simulated GPU model servers, so routing quality can be measured without GPUs.

Each simulated pod is a vLLM-v1-like engine (`engine`: scheduler, KV cache with prefix
caching, LoRA slots, chunked prefill, preemption; pure and stepped by the caller) behind
a real HTTP server (`pod`: OpenAI-compatible completions with SSE streaming, `/v1/models`,
`/health`, `/metrics` in vLLM, SGLang, TGI or Triton flavour). Hardware is a profile
(`profiles`: an H100-like and an A10G-like one with the public ratios between them, and an
analytic capacity estimate). `fleet` runs many pods in one process; `oracle` is the
exact-state router that bounds what any router can achieve; `probe` measures what a pod
sustains. The load generator lives in `loadgen`.

This package does I/O (`pod`, `fleet`, `oracle`, `probe`); `profiles`, `kv_cache`, `stats`,
`engine`, `metrics_text`, `openai_api` and `sglang_api` (SGLang's own endpoints) are pure.
"""

from __future__ import annotations

from llm_sim.engine import Engine, EngineRequest, EngineState, FinishReason, StepOutcome
from llm_sim.fleet import Fleet, PodSpec
from llm_sim.metrics_text import Flavour, render_metrics
from llm_sim.oracle import OracleRouter, predicted_ttft
from llm_sim.pod import BACKEND_ID_HEADER, DEFAULT_MODEL, PodSnapshot, SimulatedPod
from llm_sim.probe import ProbeResult, saturation_probe
from llm_sim.profiles import A10G, H100, Capacity, HardwareProfile, nominal_capacity

__all__ = [
    "A10G",
    "BACKEND_ID_HEADER",
    "Capacity",
    "DEFAULT_MODEL",
    "Engine",
    "EngineRequest",
    "EngineState",
    "FinishReason",
    "Flavour",
    "Fleet",
    "H100",
    "HardwareProfile",
    "OracleRouter",
    "PodSnapshot",
    "PodSpec",
    "ProbeResult",
    "SimulatedPod",
    "StepOutcome",
    "nominal_capacity",
    "predicted_ttft",
    "render_metrics",
    "saturation_probe",
]
