from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from xds_testbed import BACKEND_ID_HEADER, ExampleBackend


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_chat_completion_with_usage(http: aiohttp.ClientSession) -> None:
    async with ExampleBackend(backend_id="b", tokens=3) as backend:
        request = {"model": "m", "messages": [{"role": "user", "content": "one two three"}]}
        async with http.post(backend.url + "/v1/chat/completions", json=request) as response:
            assert response.status == 200
            assert response.headers[BACKEND_ID_HEADER] == "b"
            body = await response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m"
    assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    recorded = backend.last_request
    assert (recorded.method, recorded.path, recorded.model) == ("POST", "/v1/chat/completions", "m")
    assert recorded.body_size == len(json.dumps(request))
    assert backend.request_count == 1


async def test_text_completion_honours_max_tokens(http: aiohttp.ClientSession) -> None:
    async with ExampleBackend(backend_id="b") as backend:
        request = {"model": "m", "prompt": "a b", "max_tokens": 2}
        async with http.post(backend.url + "/v1/completions", json=request) as response:
            body = await response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "tok0 tok1"
    assert body["usage"]["prompt_tokens"] == 2


async def test_streaming_is_server_sent_events(http: aiohttp.ClientSession) -> None:
    async with ExampleBackend(backend_id="b", tokens=3, token_delay=0.001) as backend:
        request = {
            "model": "m",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "x"}],
        }
        async with http.post(backend.url + "/v1/chat/completions", json=request) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = await response.read()
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:3]) == "tok0 tok1 tok2"
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3
    assert backend.streams_finished == 1


async def test_hold_pauses_a_stream_after_its_first_chunk(http: aiohttp.ClientSession) -> None:
    hold = asyncio.Event()
    async with ExampleBackend(backend_id="b", tokens=2, hold=hold) as backend:
        request = {"model": "m", "stream": True, "prompt": "x"}
        async with http.post(backend.url + "/v1/completions", json=request) as response:
            first = await asyncio.wait_for(response.content.readline(), 2)
            assert json.loads(first[len(b"data: ") :])["choices"][0]["text"] == "tok0 "
            await asyncio.sleep(0.05)
            assert backend.streams_finished == 0
            hold.set()
            await response.read()
        assert backend.streams_finished == 1


async def test_models_health_and_bad_json(http: aiohttp.ClientSession) -> None:
    async with ExampleBackend(backend_id="b", models=["m1", "m2"]) as backend:
        async with http.get(backend.url + "/v1/models") as response:
            assert [m["id"] for m in (await response.json())["data"]] == ["m1", "m2"]
        async with http.get(backend.url + "/health") as response:
            assert response.status == 200
        async with http.post(backend.url + "/v1/completions", data=b"{nope") as response:
            assert response.status == 400
            assert response.headers[BACKEND_ID_HEADER] == "b"
        assert backend.request_count == 3
