"""The routing the builders describe, shown through a real Envoy 1.40.

Envoy runs from a static bootstrap built from the same builders the xDS server serves
(routes inline in the connection manager, endpoints inline in each cluster), in front of
small OpenAI-compatible backends. One Envoy and one set of backends serve the whole
module; each test looks at the requests it caused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.envoy.static_bootstrap import static_bootstrap
from xds_server.config import RoutingConfig
from xds_server.envoy import names
from xds_testbed import BACKEND_ID_HEADER, EnvoyProcess, ExampleBackend

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_REQUEST_BYTES = 10 * 1024 * 1024
MODEL_HEADER = "x-gateway-model-name"


@dataclass
class Stack:
    envoy: EnvoyProcess
    url: str
    http: aiohttp.ClientSession
    a1: ExampleBackend  # pool alpha, weight 3
    a2: ExampleBackend  # pool alpha, weight 1
    b1: ExampleBackend  # pool beta
    s1: ExampleBackend  # pool stream; holds its streams until `hold` is set
    hold: asyncio.Event

    async def post(
        self,
        body: Any,
        *,
        headers: dict[str, str] | None = None,
        path: str = "/v1/chat/completions",
    ) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers = {"content-type": "application/json", **(headers or {})}
        async with self.http.post(self.url + path, data=data, headers=all_headers) as response:
            return response.status, dict(response.headers), await response.read()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack() -> AsyncIterator[Stack]:
    hold = asyncio.Event()
    async with AsyncExitStack() as exits:
        a1, a2, b1 = [
            await exits.enter_async_context(ExampleBackend(backend_id=name))
            for name in ("a1", "a2", "b1")
        ]
        s1 = await exits.enter_async_context(ExampleBackend(backend_id="s1", tokens=5, hold=hold))
        config = RoutingConfig.model_validate(
            {
                "listener": {
                    "address": "127.0.0.1",
                    "port": 0,
                    "model_header": MODEL_HEADER,
                    "max_request_bytes": MAX_REQUEST_BYTES,
                },
                "pools": [
                    {
                        "name": "alpha",
                        "models": ["model-a"],
                        "endpoints": [
                            {"address": "127.0.0.1", "port": a1.port, "weight": 3},
                            {"address": "127.0.0.1", "port": a2.port, "weight": 1},
                        ],
                    },
                    {
                        "name": "beta",
                        "models": ["model-b", "50%-model"],
                        "endpoints": [{"address": "127.0.0.1", "port": b1.port}],
                    },
                    {
                        "name": "stream",
                        "models": ["model-s"],
                        "endpoints": [{"address": "127.0.0.1", "port": s1.port}],
                    },
                    {"name": "empty", "models": ["model-e"]},
                ],
            }
        )
        envoy = await exits.enter_async_context(EnvoyProcess(static_bootstrap(config)))
        await envoy.wait_live()
        port = await envoy.listener_port(names.LISTENER_NAME)
        http = await exits.enter_async_context(aiohttp.ClientSession())
        exits.callback(hold.set)  # never leave a held stream behind
        yield Stack(envoy, f"http://127.0.0.1:{port}", http, a1, a2, b1, s1, hold)


def _error(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """The OpenAI error object of a refusal, checking its shape on the way."""
    assert headers["Content-Type"] == "application/json", (status, body)
    document = json.loads(body)
    assert set(document) == {"error"}
    error: dict[str, Any] = document["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_body_model_routes_to_its_pool(stack: Stack) -> None:
    status, headers, _ = await stack.post({"model": "model-b", "messages": []})
    assert status == 200
    assert headers[BACKEND_ID_HEADER] == "b1"
    assert stack.b1.last_headers[names.ROUTED_MODEL_HEADER] == "model-b"
    # No route timeout: Envoy's 15 s default would cut long generations.
    assert "x-envoy-expected-rq-timeout-ms" not in stack.b1.last_headers

    status, headers, _ = await stack.post({"model": "model-a", "messages": []})
    assert status == 200
    assert headers[BACKEND_ID_HEADER] in {"a1", "a2"}


async def test_header_routes_when_the_body_has_no_model(stack: Stack) -> None:
    status, headers, _ = await stack.post({"messages": []}, headers={MODEL_HEADER: "model-b"})
    assert status == 200
    assert headers[BACKEND_ID_HEADER] == "b1"
    # A request without a body (and without a content-type) routes by header too.
    async with stack.http.post(
        stack.url + "/v1/completions",
        headers={MODEL_HEADER: "model-b"},
        skip_auto_headers=["content-type"],
    ) as response:
        assert response.headers[BACKEND_ID_HEADER] == "b1"
        assert stack.b1.last_request.path == "/v1/completions"
        assert stack.b1.last_request.body_size == 0


async def test_the_body_wins_over_the_header(stack: Stack) -> None:
    status, headers, _ = await stack.post(
        {"model": "model-b", "messages": []}, headers={MODEL_HEADER: "model-a"}
    )
    assert status == 200
    assert headers[BACKEND_ID_HEADER] == "b1"
    # The client's header named another model: upstream sees the one routed by.
    assert stack.b1.last_headers[names.ROUTED_MODEL_HEADER] == "model-b"


async def test_a_percent_sign_in_a_model_name_stays_literal(stack: Stack) -> None:
    status, headers, _ = await stack.post({"model": "50%-model"})
    assert status == 200
    assert headers[BACKEND_ID_HEADER] == "b1"
    assert stack.b1.last_headers[names.ROUTED_MODEL_HEADER] == "50%-model"


async def test_a_missing_model_is_a_400(stack: Stack) -> None:
    before = stack.b1.request_count
    status, headers, body = await stack.post({"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400
    error = _error(status, headers, body)
    assert error["code"] == "missing_model"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    # No body at all, and no header.
    async with stack.http.post(
        stack.url + "/v1/chat/completions", skip_auto_headers=["content-type"]
    ) as response:
        assert response.status == 400
        error = _error(response.status, dict(response.headers), await response.read())
        assert error["code"] == "missing_model"
    # `"model": null` is JSON for "no model".
    status, headers, body = await stack.post({"model": None})
    assert (status, _error(status, headers, body)["code"]) == (400, "missing_model")
    assert stack.b1.request_count == before


async def test_a_body_that_is_not_json_is_a_400(stack: Stack) -> None:
    status, headers, body = await stack.post(b'{"model": "model-b", ')
    assert status == 400
    assert _error(status, headers, body)["code"] == "invalid_json"
    status, headers, body = await stack.post(
        b'{"model": "model-b"}', headers={"content-type": "text/plain"}
    )
    assert (status, _error(status, headers, body)["code"]) == (400, "invalid_json")


async def test_a_model_that_is_not_a_string_is_a_400(stack: Stack) -> None:
    for value in (42, True):
        status, headers, body = await stack.post({"model": value})
        assert status == 400, value
        assert _error(status, headers, body)["code"] == "invalid_type"


async def test_an_unknown_model_is_a_404_naming_it(stack: Stack) -> None:
    status, headers, body = await stack.post({"model": "no-such-model"})
    assert status == 404
    error = _error(status, headers, body)
    assert error["code"] == "model_not_found"
    assert "`no-such-model`" in error["message"]
    # Quotes and backslashes in the name are escaped: the body stays valid JSON.
    status, headers, body = await stack.post({"model": 'a"b\\c'})
    assert status == 404
    assert '`a"b\\c`' in _error(status, headers, body)["message"]
    # A long name is echoed truncated.
    status, headers, body = await stack.post({"model": "x" * 5000})
    assert status == 404
    assert len(_error(status, headers, body)["message"]) < 400
    # Named by the header only.
    status, headers, body = await stack.post({}, headers={MODEL_HEADER: "no-such-model"})
    assert status == 404
    assert "`no-such-model`" in _error(status, headers, body)["message"]


async def test_json_with_a_charset_passes(stack: Stack) -> None:
    for content_type in ("application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        status, headers, _ = await stack.post(
            {"model": "model-b"}, headers={"content-type": content_type}
        )
        assert status == 200, content_type
        assert headers[BACKEND_ID_HEADER] == "b1"


async def test_an_8_mb_prompt_passes_and_a_larger_than_limit_one_is_a_413(stack: Stack) -> None:
    prompt = "word " * (8 * 1024 * 1024 // 5)
    body = json.dumps({"model": "model-b", "prompt": prompt}).encode()
    assert len(body) > 8 * 1024 * 1024
    status, headers, _ = await stack.post(body, path="/v1/completions")
    assert status == 200
    assert headers[BACKEND_ID_HEADER] == "b1"
    assert stack.b1.last_request.body_size == len(body)

    too_big = json.dumps({"model": "model-b", "prompt": "w" * MAX_REQUEST_BYTES}).encode()
    status, headers, body = await stack.post(too_big, path="/v1/completions")
    assert status == 413
    assert _error(status, headers, body)["code"] == "request_too_large"


async def test_server_sent_events_stream_chunk_by_chunk(stack: Stack) -> None:
    request = {"model": "model-s", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with stack.http.post(stack.url + "/v1/chat/completions", json=request) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(response.content.readline(), 5)
        # The backend is still holding the rest of the response.
        assert first.startswith(b"data: {")
        assert stack.s1.streams_started == 1
        assert stack.s1.streams_finished == 0
        assert json.loads(first[len(b"data: ") :])["choices"][0]["delta"]["content"] == "tok0 "
        stack.hold.set()
        rest = await asyncio.wait_for(response.content.read(), 5)
    events = [e for e in (first + rest).split(b"\n\n") if e]
    assert len(events) == 5 + 1
    assert events[-1] == b"data: [DONE]"
    assert stack.s1.streams_finished == 1


async def test_an_empty_pool_is_a_503_json(stack: Stack) -> None:
    status, headers, body = await stack.post({"model": "model-e"})
    assert status == 503
    error = _error(status, headers, body)
    assert error["code"] == "no_healthy_upstream"
    assert error["type"] == "server_error"


async def test_endpoint_weights_split_traffic(stack: Stack) -> None:
    before = {b.backend_id: b.request_count for b in (stack.a1, stack.a2)}
    total = 300
    # One at a time: with no request in flight, weighted least request is a pure
    # weighted pick (its `weight / (active + 1)` only shifts load under concurrency).
    for _ in range(total):
        status, _, _ = await stack.post({"model": "model-a"})
        assert status == 200
    a1 = stack.a1.request_count - before["a1"]
    a2 = stack.a2.request_count - before["a2"]
    assert a1 + a2 == total
    assert 0.65 <= a1 / total <= 0.85, (a1, a2)  # weights 3:1 → 75% on a1
