"""The simulator against a live vLLM: the fast tier compares it with recorded pages
(tests/llm_sim/test_vllm_fidelity.py); this compares it with the vLLM installed now, so a
new vLLM that renames, retypes or relabels a family the policy reads fails here."""

from __future__ import annotations

import contextlib

import aiohttp

from llm_sim.pod import SimulatedPod
from tests.llm_sim.fidelity import (
    FAST,
    loaded_page,
    metric_drift,
    sample_shapes,
    simulated_stream,
    stream_shape,
)
from tests.real.traffic import loaded_lora_page, streamed
from tests.real.vllm_pods import VllmPod


async def test_the_simulator_matches_a_live_vllm(pods: list[VllmPod]) -> None:
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        sim = await stack.enter_async_context(
            SimulatedPod("pod-a", profile=FAST, adapters=("a", "b"))
        )
        real = sample_shapes(await loaded_lora_page(http, pods[0]))
        assert metric_drift(real, sample_shapes(await loaded_page(http, sim))) == []
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hello there"}),
        ):
            live = stream_shape(await streamed(http, pods[0], path, body))
            assert stream_shape(await simulated_stream(http, sim, path, body)) == live, path
