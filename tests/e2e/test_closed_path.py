"""The closed data path, through a real Envoy configured by this server over ADS.

Only POSTs on the paths of the pools' APIs (by default `/v1/chat/completions`,
`/v1/completions` and `/v1/responses`) reach a model server. Envoy
answers `GET /v1/models` and `GET /v1/models/{id}` itself from the config, everything else
with a JSON 404 (or 405), and every reply it makes itself, down to a 431 for headers too
large, is an OpenAI-style JSON error. The client is the OpenAI Python SDK where it has a
call for the request; raw sockets send what no well-behaved client would.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from xds_server.apis import DEFAULT_APIS, paths_of
from xds_server.envoy import names
from xds_server.envoy.listeners import EARLY_REPLIES
from xds_server.envoy.routes import MODELS_PATH
from xds_testbed import BACKEND_ID_HEADER

BASE = "meta-llama/Llama-3.1-8B"  # a `/` in the id: the SDK sends it as %2F
ADAPTER = "sql-lora"
FORWARDED_PATHS = paths_of(DEFAULT_APIS)
OTHER = "qwen3-32b"
CANARY = "llama-canary"


async def _gateway(backends: Any, config_file: Any, gateway_factory: Any) -> tuple[Any, ...]:
    """Two pools, one with a LoRA adapter, and a split over both; returns the gateway and
    the two backends."""
    llama, qwen = await backends("llama-0"), await backends("qwen-0")
    config_file.write(
        {"llama": ([BASE], [(llama, 1)]), "qwen": ([OTHER], [(qwen, 1)])},
        adapters={"llama": [ADAPTER]},
        model_rewrites=[
            {
                "model": CANARY,
                "targets": [{"model": BASE, "weight": 3}, {"model": OTHER, "weight": 1}],
            }
        ],
    )
    gateway = await gateway_factory()
    return gateway, llama, qwen


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="not-checked", max_retries=0)


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


async def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as bytes on a new connection; the status line's code, the headers
    (lower-case names) and the body of the reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
        return int(status_line.split()[1]), headers, body
    finally:
        writer.close()


def _error(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """The OpenAI error object of a reply Envoy made, checking its shape on the way."""
    assert headers["content-type"] == "application/json", (status, headers, body)
    document = json.loads(body)
    assert set(document) == {"error"}, document
    error: dict[str, Any] = document["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


async def test_the_sdk_lists_and_retrieves_the_models_of_the_config(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    gateway, llama, qwen = await _gateway(backends, config_file, gateway_factory)
    async with _client(gateway.url) as client:
        page = await client.models.list()
        models = {m.id: m for m in page.data}
        assert list(models) == sorted([BASE, ADAPTER, OTHER, CANARY])
        assert {m.id: m.owned_by for m in page.data} == {
            BASE: "llama",
            ADAPTER: "llama",
            OTHER: "qwen",
            CANARY: "llama or qwen",
        }
        assert {m.object for m in page.data} == {"model"}
        # `created` is fixed (the route config's version is a content hash).
        assert {m.created for m in page.data} == {0}
        # An adapter names its base model; models have no parent.
        assert (models[ADAPTER].model_extra or {}).get("parent") == BASE
        assert "parent" not in (models[BASE].model_extra or {})

        # One model each: the SDK encodes the `/` of an id as %2F.
        for model_id, model in models.items():
            assert await client.models.retrieve(model_id) == model
        with pytest.raises(openai.NotFoundError) as refused:
            await client.models.retrieve("no-such-model")
        assert refused.value.status_code == 404
        assert refused.value.code == "model_not_found"
        assert refused.value.param == "model"

        # The model server is never asked.
        assert llama.requests == qwen.requests == []

        # An id with its `/` left as is (older SDKs, curl) is the same model.
        async with http.get(f"{gateway.url}{MODELS_PATH}/{BASE}") as response:
            assert response.status == 200
            assert (await response.json())["id"] == BASE
        assert llama.requests == []


async def test_completions_still_go_through_the_sdk(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory
) -> None:
    gateway, llama, qwen = await _gateway(backends, config_file, gateway_factory)
    async with _client(gateway.url) as client:
        chat = await client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content == "tok0 tok1 tok2"
        assert llama.last_request.path == "/v1/chat/completions"
        assert llama.last_headers[names.ROUTED_MODEL_HEADER] == BASE

        stream = await client.chat.completions.create(
            model=OTHER, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "tok0 tok1 tok2 tok3"
        assert qwen.last_request.path == "/v1/chat/completions"

        completion = await client.completions.create(model=ADAPTER, prompt="a b c", max_tokens=2)
        assert completion.choices[0].text == "tok0 tok1"
        assert llama.last_request.path == "/v1/completions"
        assert llama.last_headers[names.ROUTED_MODEL_HEADER] == ADAPTER

        # The split still picks a target per request.
        for _ in range(20):
            await client.chat.completions.create(model=CANARY, messages=[], max_tokens=1)
        routed = [
            r.headers[names.ROUTED_MODEL_HEADER]
            for r in llama.requests + qwen.requests
            if r.model == CANARY
        ]
        assert len(routed) == 20 and set(routed) <= {BASE, OTHER}

        # Refusals of a forwarded path keep their codes.
        with pytest.raises(openai.NotFoundError) as refused:
            await client.chat.completions.create(model="no-such-model", messages=[])
        assert refused.value.code == "model_not_found"


async def test_other_paths_are_json_404s_that_reach_no_model_server(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory
) -> None:
    gateway, llama, qwen = await _gateway(backends, config_file, gateway_factory)
    port = _port(gateway.url)
    naming = f"{names.ROUTED_MODEL_HEADER}: {BASE}\r\n".encode()
    body = json.dumps({"model": BASE, "messages": []}).encode()
    json_body = b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    cases = [
        # The model server's own metrics, naming a served model (this used to answer).
        (b"GET /metrics", naming, 404, "not_found"),
        (b"GET /health", naming, 404, "not_found"),
        (b"GET /v1/unknown", naming, 404, "not_found"),
        (b"GET /../metrics", naming, 404, "not_found"),
        (b"GET /v1/../metrics", naming, 404, "not_found"),
        (b"POST /metrics", json_body, 404, "not_found"),
        # An API no pool lists (`pools[].api`), naming a served model.
        (b"POST /v1/embeddings", json_body, 404, "not_found"),
        (b"POST /rerank", json_body, 404, "not_found"),
        # Near misses of a forwarded path are other paths (no normalization).
        (b"POST /v1//chat/completions", json_body, 404, "not_found"),
        (b"POST /v1/./chat/completions", json_body, 404, "not_found"),
        (b"POST /v1/chat%2Fcompletions", json_body, 404, "not_found"),
        (b"POST /V1/completions", json_body, 404, "not_found"),
        (b"POST /v1/completions/", json_body, 404, "not_found"),
        # A served path with another method.
        (b"GET /v1/chat/completions", naming, 405, "method_not_allowed"),
        (b"POST /v1/models", json_body, 405, "method_not_allowed"),
        (b"DELETE /v1/models/" + BASE.encode(), b"", 405, "method_not_allowed"),
    ]
    for start_line, headers, status, code in cases:
        sent = body if start_line.startswith(b"POST") else b""
        request = start_line + b" HTTP/1.1\r\nhost: gw\r\n" + headers + b"\r\n" + sent
        got, reply_headers, reply = await _raw(port, request)
        assert (got, _error(got, reply_headers, reply)["code"]) == (status, code), start_line
        if status == 405:
            allowed = "POST" if b"completions" in start_line else "GET"
            assert reply_headers["allow"] == allowed, start_line
    # OpenAI's words for a path it does not serve, echoing method and path.
    got, headers, reply = await _raw(port, b"GET /metrics HTTP/1.1\r\nhost: gw\r\n\r\n")
    assert _error(got, headers, reply)["message"] == "Invalid URL (GET /metrics)."
    assert llama.requests == qwen.requests == []


async def test_any_path_and_method_reaches_a_model_server_only_if_allowed(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory
) -> None:
    """Hypothesis: odd paths and methods, each naming a served model in the header. Only a
    POST on an allowed path reaches a model server; everything else is a JSON error."""
    gateway, llama, qwen = await _gateway(backends, config_file, gateway_factory)
    port = _port(gateway.url)
    near = st.sampled_from(
        ["/", "/v1", "/v1/", *FORWARDED_PATHS, MODELS_PATH, f"{MODELS_PATH}/", "/metrics", "/.."]
    )
    tail = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=12)
    methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"])

    @settings(
        max_examples=80,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(method=methods, path=st.tuples(near, tail).map("".join))
    @example(method="POST", path="/v1/completions")
    @example(method="POST", path="/v1/chat/completions?x=1")
    @example(method="GET", path="/metrics")
    @example(method="GET", path=f"{MODELS_PATH}/{OTHER}")
    @example(method="POST", path="/v1/completions#x")
    def check(method: str, path: str) -> None:
        before = len(llama.requests) + len(qwen.requests)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            connection.request(method, path, headers={names.ROUTED_MODEL_HEADER: OTHER})
            response = connection.getresponse()
            status, headers, body = (
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                response.read(),
            )
        finally:
            connection.close()
        reached = len(llama.requests) + len(qwen.requests) - before
        forwarded = (
            method == "POST" and path.split("?", 1)[0] in FORWARDED_PATHS and "#" not in path
        )
        if forwarded:
            assert (reached, headers.get(BACKEND_ID_HEADER)) == (1, "qwen-0"), (method, path)
            return
        assert reached == 0, (method, path)
        assert BACKEND_ID_HEADER not in headers, (method, path)
        if status == 200:  # the model list, or a model object
            assert method == "GET" and path.startswith(MODELS_PATH), path
            assert json.loads(body)["object"] in {"list", "model"}
        else:
            assert status in {400, 404, 405}, (method, path, status, body)
            assert _error(status, headers, body)["code"], (method, path)

    await asyncio.to_thread(check)


# What Envoy refuses before its filters read a request, and the `code` it answers with.
EARLY_REFUSALS = {
    # Headers over the listener's 32 KiB (max_request_headers_kb), or over 100 of them.
    "431 size": (b"GET / HTTP/1.1\r\nx-big: " + b"a" * 70_000 + b"\r\n", 431),
    "431 a 40 KB header": (b"GET / HTTP/1.1\r\nx-big: " + b"a" * 40_000 + b"\r\n", 431),
    "431 count": (b"GET / HTTP/1.1\r\n" + b"".join(b"x-%d: v\r\n" % i for i in range(120)), 431),
    "HTTP/1.0": (b"GET /v1/models HTTP/1.0\r\n", 426),
    "not HTTP": (b"NOT HTTP AT ALL\r\n", 400),
    "no Host": (b"GET /v1/models HTTP/1.1\r\n", 400),
    "a fragment": (b"GET /v1/models#x HTTP/1.1\r\n", 400),
    "an unknown method": (b"BREW /pot HTTP/1.1\r\n", 400),
    "an Upgrade": (
        b"GET /v1/models HTTP/1.1\r\nupgrade: websocket\r\nconnection: upgrade\r\n",
        403,
    ),
    "a transfer-encoding": (b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: gzip\r\n", 501),
    "* as the path": (b"OPTIONS * HTTP/1.1\r\n", 404),
}


async def test_replies_envoy_makes_before_routing_are_json(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory
) -> None:
    gateway, llama, qwen = await _gateway(backends, config_file, gateway_factory)
    port = _port(gateway.url)
    for what, (head, status) in EARLY_REFUSALS.items():
        host = b"" if what in {"no Host", "not HTTP"} else b"host: gw\r\n"
        got, headers, body = await _raw(port, head + host + b"\r\n")
        error = _error(got, headers, body)
        assert (got, error["code"]) == (status, EARLY_REPLIES[status][0]), what
        assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
        # Envoy's reason, for whoever reads the error.
        assert error["message"].endswith(")."), error
    assert llama.requests == qwen.requests == []


async def test_a_client_that_sends_its_headers_too_slowly_is_closed(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory
) -> None:
    """A slowloris (headers trickling in, never finished) holds a connection only for
    `listener.request_headers_timeout_s`; other clients are served meanwhile."""
    llama = await backends("llama")
    config_file.write(
        {"llama": (["llama"], [(llama, 1)])}, listener={"request_headers_timeout_s": 1.0}
    )
    gateway = await gateway_factory()
    port = _port(gateway.url)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        started = loop.time()
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nx-slow: ")
        await writer.drain()
        got, _, _ = await _raw(port, b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n")
        assert got == 200
        # Envoy answers (408) and closes; the read ends at the close, long before 30 s.
        await asyncio.wait_for(reader.read(), 30)
        assert reader.at_eof()
        assert loop.time() - started >= 0.5
    finally:
        writer.close()
