"""Faults of a simulated pod over real HTTP: a kill refuses and cuts, a revive serves on the
same port with a fresh engine, a reset cuts only the requests without a first token; and the
gray failures, where `/metrics` and `/health` answer while completions do not: a wedged pod
stops after N chunks, a resetting pod resets every completion, a frozen pod answers nothing
until it is thawed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_sim.pod import PodState, SimulatedPod
from llm_sim.profiles import H100

FAST = H100.scaled(0.1)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def chat(words: int, max_tokens: int, *, stream: bool = True) -> dict[str, object]:
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [{"role": "user", "content": " ".join(["w"] * words)}],
        "max_tokens": max_tokens,
        "stream": stream,
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


async def _status(http: aiohttp.ClientSession, url: str, body: dict[str, object] | None) -> int:
    """A GET (no body) or a POST's status, once its whole body is in."""
    method = "GET" if body is None else "POST"
    async with http.request(method, url, json=body) as response:
        await response.read()
        return response.status


async def _event(response: aiohttp.ClientResponse) -> str:
    """The next SSE event's text (the words it carries), or "[DONE]"."""
    raw = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 30)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n"), raw
    payload = raw[len(b"data: ") : -2]
    if payload == b"[DONE]":
        return "[DONE]"
    return str(json.loads(payload)["choices"][0]["delta"]["content"])


async def _silent(response: aiohttp.ClientResponse) -> bool:
    """Whether a full second passes without a byte (nor the end) of `response`'s body."""
    try:
        await asyncio.wait_for(response.content.readany(), 1.0)
    except TimeoutError:
        return True
    return False


def _gauge(page: str, name: str) -> float:
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not on the page.")


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


async def test_wedged_pod_streams_n_chunks_then_nothing_while_metrics_answer(
    http: aiohttp.ClientSession,
) -> None:
    async with SimulatedPod("pod-w", profile=H100, stream_interval=2) as pod:
        url = pod.url + "/v1/chat/completions"
        pod.wedge(3)
        plain = asyncio.create_task(_status(http, url, chat(8, 100, stream=False)))
        async with http.post(url, json=chat(8, 100)) as response:
            assert response.status == 200
            chunks = [await _event(response) for _ in range(3)]
            # The first token, then two chunks of `stream_interval` tokens; then silence.
            assert [len(chunk.split()) for chunk in chunks] == [1, 2, 2]
            # The non-streamed request stops at the same 5 tokens, short of its 100.
            await _until(lambda: pod.state_snapshot().engine.running_remaining_tokens == (95, 95))
            generated = pod.state_snapshot().engine.generation_tokens_total
            assert await _silent(response)
            assert not plain.done()
            engine = pod.state_snapshot().engine
            assert engine.generation_tokens_total == generated
            # Healthy to look at: both stuck requests run, with their KV blocks.
            assert engine.num_running == 2 and engine.kv_blocks_used > 0
            assert await _status(http, pod.url + "/health", None) == 200
            async with http.get(pod.url + "/metrics") as metrics:
                assert metrics.status == 200
                assert _gauge(await metrics.text(), "vllm:num_requests_running") == 2
            pod.unwedge()
            rest = [await _event(response)]
            while rest[-1] != "[DONE]":
                rest.append(await _event(response))
        assert sum(len(chunk.split()) for chunk in chunks + rest[:-1]) == 100
        assert await asyncio.wait_for(plain, 30) == 200


async def test_wedge_stops_a_stream_already_running(http: aiohttp.ClientSession) -> None:
    async with SimulatedPod("pod-w2", profile=H100) as pod:
        async with http.post(pod.url + "/v1/chat/completions", json=chat(8, 200)) as response:
            for _ in range(3):
                await _event(response)
            pod.wedge(1)
            generated = pod.state_snapshot().engine.generation_tokens_total
            # What was out before the wedge still comes (the client may lag); then nothing.
            reads = 0
            while not await _silent(response):
                reads += 1
                assert reads < 20
            engine = pod.state_snapshot().engine
            assert engine.generation_tokens_total == generated
            assert engine.num_running == 1


async def test_resetting_pod_resets_completions_while_metrics_answer(
    http: aiohttp.ClientSession,
) -> None:
    async with SimulatedPod("pod-x", profile=FAST) as pod:
        url = pod.url + "/v1/chat/completions"
        pod.reset_requests(True)
        for body in (chat(8, 4), chat(8, 4, stream=False)):
            with pytest.raises(aiohttp.ClientOSError) as reset:
                await _status(http, url, body)
            assert isinstance(reset.value.__cause__, ConnectionResetError)
        assert await _status(http, pod.url + "/metrics", None) == 200
        assert await _status(http, pod.url + "/health", None) == 200
        engine = pod.state_snapshot().engine
        assert engine.num_waiting == engine.num_running == engine.prompt_tokens_total == 0
        pod.reset_requests(False)
        assert await _stream(http, pod.url, chat(8, 4)) == "done"


async def test_frozen_pod_answers_nothing_until_thawed_then_goes_on(
    http: aiohttp.ClientSession,
) -> None:
    loop = asyncio.get_running_loop()
    # A catch-up window far longer than the freeze: only the thaw's re-anchoring keeps the
    # step loop from running the frozen time's steps in a burst.
    async with SimulatedPod("pod-f", profile=H100, max_catch_up_s=60) as pod:
        async with http.post(pod.url + "/v1/chat/completions", json=chat(8, 40)) as running:
            words = [await _event(running)]
            pod.freeze()
            frozen_at = loop.time()
            steps = pod.state_snapshot().steps
            metrics = asyncio.create_task(_status(http, pod.url + "/metrics", None))
            sent = asyncio.create_task(_stream(http, pod.url, chat(8, 4)))
            done, _ = await asyncio.wait({metrics, sent}, timeout=1.0)
            assert not done
            assert pod.state_snapshot().steps == steps
            pod.thaw()
            frozen_s = loop.time() - frozen_at
            assert await asyncio.wait_for(metrics, 30) == 200
            assert await asyncio.wait_for(sent, 30) == "done"
            while words[-1] != "[DONE]":
                words.append(await _event(running))
        assert sum(len(chunk.split()) for chunk in words[:-1]) == 40
        # Steps are not late by the frozen time: it was lost, not caught up.
        assert pod.state_snapshot().lag_s_max < frozen_s / 2
