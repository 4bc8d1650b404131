"""The simulator against a real vLLM's recorded pages and streams (tests/fixtures/vllm/,
vLLM 0.32.0's CPU build, recorded by tests/real/record_fixtures.py): every family the
policy reads is there with the real type and label names, and streams are framed alike.
`./dev test-real` checks the same against a live vLLM (tests/real/test_fidelity_live.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llm_sim.pod import SimulatedPod
from tests.llm_sim.fidelity import (
    FAST,
    SampleShape,
    loaded_page,
    metric_drift,
    policy_samples,
    sample_shapes,
    simulated_page,
    simulated_stream,
    stream_shape,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm"


@pytest.fixture
async def pod() -> AsyncIterator[SimulatedPod]:
    async with SimulatedPod("pod-a", profile=FAST, adapters=("a", "b")) as pod:
        yield pod


def test_the_recorded_pages_have_what_the_policy_reads() -> None:
    """The fixtures are a real page: waiting, running, KV use and size, the prefix-cache,
    token and request counters, and (under load, with an adapter) the LoRA family."""
    idle = sample_shapes((FIXTURES / "metrics-idle.txt").read_text())
    load = sample_shapes((FIXTURES / "metrics-load.txt").read_text())
    assert (
        policy_samples()
        - {
            "vllm:gpu_cache_usage_perc",
            "vllm:gpu_prefix_cache_hits_total",
            "vllm:gpu_prefix_cache_queries_total",
            "vllm:lora_requests_info",
        }
        <= idle.keys()
    )
    assert load["vllm:lora_requests_info"] == SampleShape(
        "gauge", frozenset({"max_lora", "running_lora_adapters", "waiting_lora_adapters"})
    )


async def test_the_simulators_page_matches_a_real_vllms_where_the_policy_reads(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    real_idle = sample_shapes((FIXTURES / "metrics-idle.txt").read_text())
    real_load = sample_shapes((FIXTURES / "metrics-load.txt").read_text())
    assert metric_drift(real_idle, sample_shapes(await simulated_page(http, pod))) == []
    assert metric_drift(real_load, sample_shapes(await loaded_page(http, pod))) == []


def test_drift_is_caught() -> None:
    """A family missing, typed or labelled otherwise is reported, by name."""
    real = sample_shapes((FIXTURES / "metrics-load.txt").read_text())
    simulated = dict(real)
    del simulated["vllm:num_requests_waiting"]
    simulated["vllm:kv_cache_usage_perc"] = SampleShape(
        "counter", real["vllm:kv_cache_usage_perc"].labels
    )
    simulated["vllm:lora_requests_info"] = SampleShape("gauge", frozenset({"max_lora"}))
    problems = metric_drift(real, simulated)
    assert [p.split(":")[0] + ":" + p.split(":")[1] for p in problems] == [
        "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:num_requests_waiting",
    ], problems


@pytest.mark.parametrize(
    ("path", "fixture", "body"),
    [
        ("/v1/chat/completions", "sse-chat.txt", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", "sse-completions.txt", {"prompt": "hello there"}),
    ],
)
async def test_the_simulators_streams_are_framed_as_a_real_vllms(
    pod: SimulatedPod,
    http: aiohttp.ClientSession,
    path: str,
    fixture: str,
    body: dict[str, Any],
) -> None:
    real = stream_shape((FIXTURES / fixture).read_bytes())
    assert real.framed and real.done_last and real.finish_once
    assert stream_shape(await simulated_stream(http, pod, path, body)) == real
