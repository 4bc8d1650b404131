"""Faults of a simulated pod over real HTTP: a kill refuses and cuts, a revive serves on the
same port with a fresh engine, a reset cuts only the requests without a first token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from llm_sim.pod import PodState, SimulatedPod
from llm_sim.profiles import H100

FAST = H100.scaled(0.1)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def chat(words: int, max_tokens: int) -> dict[str, object]:
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [{"role": "user", "content": " ".join(["w"] * words)}],
        "max_tokens": max_tokens,
        "stream": True,
    }


def _state(pod: SimulatedPod) -> PodState:
    return pod.state


async def _until(condition: Callable[[], bool]) -> None:
    """Poll the pod's state (it has no events to wait on)."""
    while not condition():  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def _stream(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> str:
    """The outcome: "done", "cut" (a 200 whose stream broke) or the HTTP status."""
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                return str(response.status)
            raw = await response.read()
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
        return "cut"
    return "done" if raw.endswith(b"data: [DONE]\n\n") else "cut"


async def test_kill_refuses_and_cuts_then_revive_serves_with_a_fresh_engine(
    http: aiohttp.ClientSession,
) -> None:
    async with SimulatedPod("pod-k", profile=FAST) as pod:
        url, port = pod.url, pod.port
        streams = [asyncio.create_task(_stream(http, url, chat(8, 2000))) for _ in range(3)]
        await _until(lambda: pod.state_snapshot().engine.num_running == 3)
        assert await pod.kill() >= 3
        assert _state(pod) is PodState.KILLED
        assert await asyncio.gather(*streams) == ["cut"] * 3
        with pytest.raises(aiohttp.ClientConnectorError):
            async with http.get(url + "/health"):
                pass
        await pod.revive()
        assert pod.port == port and _state(pod) is PodState.OPEN
        assert pod.state_snapshot().engine.num_running == 0
        assert await _stream(http, url, chat(8, 4)) == "done"
        async with http.get(url + "/metrics") as response:
            page = await response.text()
        assert 'vllm:request_success_total{engine="0",finished_reason="length"' in page
    assert _state(pod) is PodState.CLOSED


async def test_reset_prefilling_cuts_only_requests_without_a_first_token(
    http: aiohttp.ClientSession,
) -> None:
    async with SimulatedPod("pod-r", profile=H100) as pod:
        decoding = asyncio.create_task(_stream(http, pod.url, chat(8, 60)))
        await _until(lambda: pod.state_snapshot().engine.num_running == 1)
        await asyncio.sleep(0.1)  # its first token is out
        # 30k tokens of prompt: seconds of prefill at 6,000 tokens/s.
        prefilling = asyncio.create_task(_stream(http, pod.url, chat(30_000, 4)))
        await _until(lambda: pod.state_snapshot().in_flight == 2)
        assert pod.reset_prefilling() == 1
        assert await prefilling == "cut"
        assert await decoding == "done"
