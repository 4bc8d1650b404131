"""The OpenAI surface a pool serves (`pools[].api`), through a real Envoy configured by
this server over ADS, in front of simulated vLLM pods, with the OpenAI Python SDK.

A chat pool (the default APIs: chat, completions, responses) and an embedding pool
(`api: [embeddings]`). The simulated pods answer both APIs for any model they serve, so a
request the gateway refuses is refused by the gateway alone: the pod's own count of
requests (`requests_seen`) shows it never arrived.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from llm_sim.pod import BACKEND_ID_HEADER, SimulatedPod
from llm_sim.profiles import H100
from llm_sim.responses_api import EMBEDDING_DIMENSIONS
from xds_server.config import RoutingConfig
from xds_server.envoy import names
from xds_testbed.gateway import LocalGateway, run_local_gateway

CHAT = "chat-model"
EMBED = "embed-model"
FAST = H100.scaled(0.1)


@dataclass
class Surface:
    gateway: LocalGateway
    chat: SimulatedPod
    embed: SimulatedPod
    client: openai.AsyncOpenAI
    http: aiohttp.ClientSession


@pytest.fixture
async def surface(tmp_path: Path) -> AsyncIterator[Surface]:
    async with (
        SimulatedPod("chat-0", profile=FAST, model=CHAT) as chat,
        SimulatedPod("embed-0", profile=FAST, model=EMBED) as embed,
    ):
        config = RoutingConfig.model_validate(
            {
                "listener": {"address": "127.0.0.1", "port": 0},
                "updates": {"debounce_s": 0.02},
                "pools": [
                    {
                        "name": "chat",
                        "models": [CHAT],
                        "gpu_aware": False,
                        "endpoints": [{"address": "127.0.0.1", "port": chat.port}],
                    },
                    {
                        "name": "embed",
                        "models": [EMBED],
                        "api": ["embeddings"],
                        "gpu_aware": False,
                        "endpoints": [{"address": "127.0.0.1", "port": embed.port}],
                    },
                ],
            }
        )
        path = tmp_path / "config.yaml"
        path.write_text(config.model_dump_json())
        async with (
            run_local_gateway(path, config_poll_s=3600) as gateway,
            openai.AsyncOpenAI(
                base_url=f"{gateway.url}/v1", api_key="not-checked", max_retries=0
            ) as client,
            aiohttp.ClientSession() as http,
        ):
            yield Surface(gateway=gateway, chat=chat, embed=embed, client=client, http=http)


async def test_responses_and_embeddings_go_through_with_the_sdk(surface: Surface) -> None:
    client = surface.client
    response = await client.responses.create(model=CHAT, input="one two three", max_output_tokens=3)
    assert response.model == CHAT and response.id.startswith("resp-chat-0-")
    assert len(response.output_text.split()) == 3
    assert response.usage is not None and response.usage.input_tokens == 3

    # Streamed: Envoy passes the server-sent events through one by one.
    stream = await client.responses.create(
        model=CHAT, input="hello", max_output_tokens=4, stream=True
    )
    events = [event async for event in stream]
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 4
    assert events[-1].response.output_text == "".join(deltas)

    embeddings = await client.embeddings.create(model=EMBED, input=["a b", "c d e"])
    assert embeddings.model == EMBED
    assert [len(d.embedding) for d in embeddings.data] == [EMBEDDING_DIMENSIONS] * 2
    assert embeddings.usage.prompt_tokens == 5

    # Chat and completions as before.
    chat = await client.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.choices[0].finish_reason == "length"
    assert surface.chat.requests_seen["POST", "/v1/responses"] == 2
    assert surface.chat.requests_seen["POST", "/v1/chat/completions"] == 1
    assert surface.embed.requests_seen["POST", "/v1/embeddings"] == 1


async def test_an_api_the_pool_does_not_list_never_reaches_its_pod(surface: Surface) -> None:
    client, chat, embed = surface.client, surface.chat, surface.embed
    # The pods would answer: each serves both APIs when asked directly.
    async with surface.http.post(
        chat.url + "/v1/embeddings", json={"model": CHAT, "input": "x"}
    ) as direct:
        assert direct.status == 200
    async with surface.http.post(
        embed.url + "/v1/responses", json={"model": EMBED, "input": "x", "max_output_tokens": 1}
    ) as direct:
        assert direct.status == 200
    chat.requests_seen.clear()
    embed.requests_seen.clear()

    with pytest.raises(openai.NotFoundError) as refused:
        await client.embeddings.create(model=CHAT, input="x")
    assert refused.value.code == "not_found"
    assert refused.value.body == {
        "message": f"Invalid URL (POST /v1/embeddings): the model `{CHAT}` is not served on "
        "this path.",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
    with pytest.raises(openai.NotFoundError) as refused:
        await client.responses.create(model=EMBED, input="x")
    assert refused.value.code == "not_found"

    # The model named by the header only, and APIs no pool lists.
    header = names.ROUTED_MODEL_HEADER  # the listener's model header, by default
    refusals = [
        ("/v1/embeddings", {"input": "x"}, {header: CHAT}),
        ("/v1/chat/completions", {"messages": []}, {header: EMBED}),
        ("/rerank", {"model": CHAT, "query": "q", "documents": ["d"]}, {}),
        ("/v1/audio/transcriptions", {"model": CHAT}, {}),
    ]
    for path, body, headers in refusals:
        async with surface.http.post(
            surface.gateway.url + path, json=body, headers=headers
        ) as response:
            document: Any = await response.json()
            assert response.status == 404, (path, document)
            assert response.headers["content-type"] == "application/json"
            assert BACKEND_ID_HEADER not in response.headers
            error = document["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "not_found", (path, document)
            if not headers and path != "/v1/embeddings":
                assert error["message"] == f"Invalid URL (POST {path}).", document

    # Not one of these reached a pod (the gateway does not scrape them: not GPU-aware).
    assert sum(chat.requests_seen.values()) == sum(embed.requests_seen.values()) == 0


async def test_the_engines_own_error_passes_through(surface: Surface) -> None:
    """A pod's error body reaches the client as the pod wrote it (docs/routing.md, whose
    error a client sees)."""
    body = {"model": CHAT, "input": "x", "max_output_tokens": 0}
    async with surface.http.post(surface.gateway.url + "/v1/responses", json=body) as response:
        assert response.status == 400
        assert response.headers[BACKEND_ID_HEADER] == "chat-0"
        passed = json.loads(await response.read())
    async with surface.http.post(surface.chat.url + "/v1/responses", json=body) as direct:
        assert passed == json.loads(await direct.read())
