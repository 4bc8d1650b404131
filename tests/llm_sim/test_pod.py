"""A simulated pod over real HTTP: the OpenAI API, SSE framing, errors, /metrics, aborts."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_sim.engine import Engine, FinishReason, StepOutcome
from llm_sim.metrics_text import Flavour
from llm_sim.openai_api import BadRequestError, parse_completion_request
from llm_sim.pod import BACKEND_ID_HEADER, SimulatedPod
from llm_sim.profiles import H100

FAST = H100.scaled(0.1)  # 3 ms steps: quick tests


@pytest.fixture
async def pod() -> AsyncIterator[SimulatedPod]:
    async with SimulatedPod("pod-a", profile=FAST, adapters=("sql-lora",), seed=5) as pod:
        yield pod


def sse_events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert "\r" not in text  # LF separators, as vLLM sends
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def chat(content: str, **extra: object) -> dict[str, object]:
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


async def test_streaming_chat_with_usage(pod: SimulatedPod, http: aiohttp.ClientSession) -> None:
    body = chat("one two three", max_tokens=4, stream=True, stream_options={"include_usage": True})
    async with http.post(pod.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers[BACKEND_ID_HEADER] == "pod-a"
        raw = await response.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4}
    content = chunks[:-1]
    assert len(content) == 4  # stream_interval 1: one token per chunk
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None, "length"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert len(text.split()) == 4 and text == " ".join(text.split())


async def test_non_streaming_completion_reports_usage(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    body = {"model": "sql-lora", "prompt": "select a b c from d", "max_tokens": 5}
    async with http.post(pod.url + "/v1/completions", json=body) as response:
        assert response.status == 200
        assert response.headers[BACKEND_ID_HEADER] == "pod-a"
        document = await response.json()
    assert document["object"] == "text_completion"
    assert document["model"] == "sql-lora"
    assert len(document["choices"][0]["text"].split()) == 5
    assert document["choices"][0]["finish_reason"] == "length"
    assert document["usage"] == {"prompt_tokens": 6, "total_tokens": 11, "completion_tokens": 5}
    state = pod.state_snapshot().engine
    assert state.loaded_adapters == ("sql-lora",)
    assert state.prompt_tokens_total == 6  # counted under the base model's series


async def test_stream_interval_batches_tokens_after_the_first(
    http: aiohttp.ClientSession,
) -> None:
    async with SimulatedPod("pod-b", profile=FAST, stream_interval=4) as pod:
        body = chat("hello", max_tokens=10, stream=True)
        async with http.post(pod.url + "/v1/chat/completions", json=body) as response:
            raw = await response.read()
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    counts = [len(c["choices"][0]["delta"]["content"].split()) for c in chunks]
    assert counts == [1, 4, 4, 1]


async def test_unknown_model_and_bad_bodies(pod: SimulatedPod, http: aiohttp.ClientSession) -> None:
    url = pod.url + "/v1/chat/completions"
    async with http.post(url, json=chat("x") | {"model": "gpt-9"}) as response:
        assert response.status == 404
        error = (await response.json())["error"]
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    async with http.post(url, data=b"{not json") as response:
        assert response.status == 400
        assert (await response.json())["error"]["code"] == "invalid_json"
    async with http.post(url, json={"messages": "hi"}) as response:
        assert response.status == 400
    async with http.post(url, json=chat("x", max_tokens=0)) as response:
        assert response.status == 400
    too_long = chat("w " * FAST.max_model_len)
    async with http.post(url, json=too_long) as response:
        assert response.status == 400
        assert "maximum context length" in (await response.json())["error"]["message"]


async def test_models_health_and_metrics(pod: SimulatedPod, http: aiohttp.ClientSession) -> None:
    async with http.get(pod.url + "/v1/models") as response:
        models = await response.json()
    assert [m["id"] for m in models["data"]] == ["meta-llama/Llama-3.1-8B-Instruct", "sql-lora"]
    assert models["data"][1]["parent"] == "meta-llama/Llama-3.1-8B-Instruct"
    async with http.get(pod.url + "/health") as response:
        assert response.status == 200
    async with http.get(pod.url + "/metrics") as response:
        assert response.headers["Content-Type"] == "text/plain; version=1.0.0; charset=utf-8"
        text = await response.text()
    assert (
        'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}'
        in text
    )
    assert 'http_requests_total{handler="/v1/models",method="GET",status="2xx"} 1.0' in text


async def test_flavour_is_per_pod(http: aiohttp.ClientSession) -> None:
    async with SimulatedPod("tgi", profile=FAST, flavour=Flavour.TGI) as pod:
        async with http.get(pod.url + "/metrics") as response:
            text = await response.text()
    assert "tgi_queue_size 0" in text and "vllm:" not in text


async def test_client_disconnect_aborts_the_request(http: aiohttp.ClientSession) -> None:
    async with SimulatedPod("slow", profile=H100) as pod:
        body = chat("a b c d", max_tokens=1000, stream=True)
        response = await http.post(pod.url + "/v1/chat/completions", json=body)
        await response.content.readuntil(b"\n\n")  # the first token
        assert pod.state_snapshot().engine.num_running == 1
        response.close()
        for _ in range(200):
            state = pod.state_snapshot().engine
            if state.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert state.finished[FinishReason.ABORT] == 1
        assert state.kv_blocks_used == 0
        assert pod.state_snapshot().in_flight == 0


@pytest.mark.parametrize("max_catch_up_s", [0.5, 0.02])
async def test_the_step_loop_catches_up_after_a_stall(
    http: aiohttp.ClientSession, max_catch_up_s: float
) -> None:
    """Steps run to absolute deadlines: a stalled event loop is caught up (no capacity lost)
    unless the stall is longer than `max_catch_up_s` (then it is dropped, and counted)."""
    profile = dataclasses.replace(
        FAST, step_base_s=0.01, step_per_seq_s=0.0, step_per_context_token_s=0.0
    )
    prefill_s = 0.01 + 3 / profile.prefill_tokens_per_s
    async with SimulatedPod("p", profile=profile, max_catch_up_s=max_catch_up_s) as pod:
        body = chat("a b c", max_tokens=30)
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, time.sleep, 0.12)  # block the whole event loop for 120 ms
        async with http.post(pod.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
        snapshot = pod.state_snapshot()
        e2e = next(
            sample.value
            for family in text_string_to_metric_families(pod.render_metrics())
            for sample in family.samples
            if sample.name == "vllm:e2e_request_latency_seconds_sum"
        )
    assert snapshot.lag_s_max >= 0.1
    if max_catch_up_s > 0.12:
        assert snapshot.lag_s_dropped == 0
        assert e2e == pytest.approx(prefill_s + 29 * 0.01, abs=0.002)  # the clock kept pace
    else:
        assert snapshot.lag_s_dropped >= 0.1
        assert e2e >= prefill_s + 29 * 0.01 + 0.1


async def test_a_dead_step_loop_fails_requests_loudly(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_step(self: Engine, now: float) -> StepOutcome:
        raise RuntimeError("simulated engine bug")

    async with SimulatedPod("doomed", profile=FAST) as pod:
        monkeypatch.setattr(Engine, "step", broken_step)
        async with http.post(pod.url + "/v1/chat/completions", json=chat("x")) as response:
            assert response.status == 503
        async with http.post(pod.url + "/v1/chat/completions", json=chat("y")) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "engine_dead"
    assert "step loop of simulated pod doomed died" in caplog.text


async def test_lifecycle_misuse_raises() -> None:
    pod = SimulatedPod("p", profile=FAST)
    with pytest.raises(RuntimeError, match="has not been started"):
        _ = pod.port
    async with pod:
        with pytest.raises(RuntimeError, match="started only once"):
            await pod.__aenter__()
    request = parse_completion_request(b'{"prompt": "x"}', chat=False)
    with pytest.raises(RuntimeError, match="closed"):
        await pod.handle_completion(None, request)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream_interval"):
        SimulatedPod("p", stream_interval=0)


def test_parsing_requests() -> None:
    parsed = parse_completion_request(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be  brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi there"}]},
                ],
                "max_completion_tokens": 7,
                "max_tokens": 99,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode(),
        chat=True,
    )
    assert parsed.prompt == ("be", "brief", "hi", "there")
    assert (parsed.model, parsed.max_tokens, parsed.stream, parsed.include_usage) == (
        None,
        7,
        True,
        True,
    )
    assert parse_completion_request(b'{"prompt": [1, 2, 3]}', chat=False).prompt == (1, 2, 3)
    for bad in (
        b"[]",
        b'{"model": 3, "prompt": "x"}',
        b'{"prompt": ""}',
        b'{"prompt": "x", "stream_options": {"include_usage": true}}',
    ):
        with pytest.raises(BadRequestError):
            parse_completion_request(bad, chat=False)
