"""How the simulator's vLLM pages and streams differ from a real vLLM's.

The policy is tested and benchmarked against the simulator, so the simulator must write
what a real vLLM writes wherever the policy reads: every family the vLLM adapter reads
(xds_server/metrics/engines.py) that the real page has must be on the simulator's page
with the same type and the same label names. Families only one side has are reported but
are not drift: a real page has dozens the policy never reads.

Streams: `data: <json>` events separated by a blank line and ended by `data: [DONE]`, the
same chunk `object`, the role alone in the first chat chunk, and the usage chunk (with
`stream_options.include_usage`) carrying no choices.

Used by the fast tier on recorded pages (tests/fixtures/vllm/) and by `./dev test-real`
on a live pod.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from llm_sim.pod import DEFAULT_MODEL, SimulatedPod
from llm_sim.profiles import H100
from xds_server.metrics.engines import engine_adapter

__all__ = [
    "FAST",
    "SampleShape",
    "StreamShape",
    "loaded_page",
    "metric_drift",
    "policy_samples",
    "sample_shapes",
    "simulated_page",
    "simulated_stream",
    "stream_shape",
]

_BUILTIN_LABELS = frozenset({"le", "quantile"})

FAST = H100.scaled(0.1)


async def simulated_page(http: aiohttp.ClientSession, pod: SimulatedPod) -> str:
    async with http.get(pod.url + "/metrics") as response:
        return await response.text()


async def simulated_stream(
    http: aiohttp.ClientSession, pod: SimulatedPod, path: str, body: dict[str, Any]
) -> bytes:
    request = {
        "model": DEFAULT_MODEL,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    async with http.post(pod.url + path, json=request) as response:
        assert response.status == 200
        return await response.read()


async def loaded_page(http: aiohttp.ClientSession, pod: SimulatedPod) -> str:
    """The pod's page while adapter `a` runs (one long request in flight)."""
    body = {"model": "a", "prompt": "hello there", "max_tokens": 2000}
    request = asyncio.create_task(http.post(pod.url + "/v1/completions", json=body))
    try:
        while True:
            page = await simulated_page(http, pod)
            if 'running_lora_adapters="a"' in page:
                return page
            await asyncio.sleep(0.01)
    finally:
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)


@dataclass(frozen=True)
class SampleShape:
    """A sample name's family type and the label names its series carry."""

    kind: str
    labels: frozenset[str]


def sample_shapes(text: str) -> dict[str, SampleShape]:
    """Sample name (a counter's with `_total`) -> its shape, over a whole page."""
    shapes: dict[str, SampleShape] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset(sample.labels) - _BUILTIN_LABELS
            known = shapes.get(sample.name)
            merged = labels if known is None else known.labels | labels
            shapes[sample.name] = SampleShape(family.type, merged)
    return shapes


def policy_samples() -> frozenset[str]:
    """The sample names the vLLM adapter reads (fallbacks for older vLLMs included)."""
    return engine_adapter("vllm").families


def metric_drift(
    real: Mapping[str, SampleShape], simulated: Mapping[str, SampleShape]
) -> list[str]:
    """Each policy-read sample the real page has and the simulator's lacks, types
    differently or labels differently; empty when they agree."""
    problems = []
    for name in sorted(policy_samples() & real.keys()):
        want, got = real[name], simulated.get(name)
        if got is None:
            problems.append(f"{name}: on the real page, missing from the simulator's")
        elif got.kind != want.kind:
            problems.append(f"{name}: a {want.kind} on the real page, a {got.kind} simulated")
        elif got.labels != want.labels:
            problems.append(
                f"{name}: labels {sorted(want.labels)} on the real page, "
                f"{sorted(got.labels)} simulated"
            )
    return problems


@dataclass(frozen=True)
class StreamShape:
    """What a client's SSE parser and the OpenAI SDK see of a streamed completion."""

    framed: bool  # every event one `data: ` line and a blank line, nothing else
    done_last: bool  # ends with `data: [DONE]`
    objects: frozenset[str]
    first_delta: tuple[str, ...]  # the keys of the first chat chunk's delta
    usage_without_choices: bool | None  # the usage chunk's choices are [] (None: no usage)
    finish_once: bool  # one chunk per choice carries a finish_reason, the last with choices


def stream_shape(raw: bytes) -> StreamShape:
    """The shape of one recorded or live SSE body."""
    text = raw.decode()
    events = text.split("\n\n")
    framed = events[-1] == "" and all(
        event.startswith("data: ") and "\n" not in event for event in events[:-1]
    )
    payloads = [event.removeprefix("data: ") for event in events[:-1]]
    chunks: list[dict[str, Any]] = [json.loads(p) for p in payloads if p != "[DONE]"]
    with_choices = [c for c in chunks if c.get("choices")]
    usage = [c for c in chunks if c.get("usage")]
    finishes = [
        i for i, c in enumerate(with_choices) if c["choices"][0].get("finish_reason") is not None
    ]
    first = with_choices[0]["choices"][0] if with_choices else {}
    return StreamShape(
        framed=framed,
        done_last=bool(payloads) and payloads[-1] == "[DONE]",
        objects=frozenset(c.get("object", "") for c in chunks),
        first_delta=tuple(sorted(first.get("delta", {}))),
        usage_without_choices=(usage[-1].get("choices") == []) if usage else None,
        finish_once=finishes == [len(with_choices) - 1],
    )
