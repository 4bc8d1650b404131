"""vLLM's tokenize and render endpoints on a simulated pod: the ids a router prefixes on."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from llm_sim.metrics_text import Flavour
from llm_sim.openai_api import parse_completion_request, render_document, token_ids
from llm_sim.pod import BACKEND_ID_HEADER, DEFAULT_MODEL, SimulatedPod
from llm_sim.profiles import H100

FAST = H100.scaled(0.1)


@pytest.fixture
async def pod() -> AsyncIterator[SimulatedPod]:
    async with SimulatedPod("pod-a", profile=FAST, adapters=("sql-lora",)) as pod:
        yield pod


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, Any, str | None]:
    async with http.post(url, json=body) as response:
        return response.status, await response.json(), response.headers.get(BACKEND_ID_HEADER)


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def test_token_ids_are_the_simulators_tokens_numbered_the_same_everywhere() -> None:
    assert token_ids(["hello", 7, "hello"]) == [zlib.crc32(b"hello"), 7, zlib.crc32(b"hello")]
    one, two = token_ids("a b c x".split()), token_ids("a b c y".split())
    assert one[:3] == two[:3] and one[3] != two[3]


async def test_tokenize_answers_vllms_tokenize_response(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    status, chat, backend = await post(
        http, pod.url + "/tokenize", {"model": DEFAULT_MODEL, "messages": messages("one two")}
    )
    assert (status, backend) == (200, "pod-a")
    assert chat == {
        "count": 4,
        "max_model_len": FAST.max_model_len,
        "tokens": token_ids("be brief one two".split()),
        "token_strs": None,
    }
    # The completion form, as the router sends it for /v1/completions.
    status, text, _ = await post(http, pod.url + "/tokenize", {"prompt": "be brief one two"})
    assert status == 200 and text == chat


async def test_chat_render_answers_a_generate_request_with_the_prompts_ids(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    body = {"model": "sql-lora", "messages": messages("one two"), "max_tokens": 5, "stream": True}
    status, document, backend = await post(http, pod.url + "/v1/chat/completions/render", body)
    assert (status, backend) == (200, "pod-a")
    assert document["request_id"].startswith("chatcmpl-")
    assert document["token_ids"] == token_ids("be brief one two".split())
    assert document["sampling_params"] == {"max_tokens": 5}
    assert (document["model"], document["stream"], document["features"]) == (
        "sql-lora",
        True,
        None,
    )
    # Rendering does not run the engine.
    assert pod.state_snapshot().engine.num_running == 0


async def test_completion_render_answers_a_list_of_one(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    status, documents, _ = await post(
        http, pod.url + "/v1/completions/render", {"prompt": "one two three"}
    )
    assert status == 200 and len(documents) == 1
    assert documents[0]["token_ids"] == token_ids(["one", "two", "three"])
    assert documents[0]["sampling_params"] == {"max_tokens": pod.default_max_tokens}
    assert documents[0]["model"] == DEFAULT_MODEL


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model_not_found"),
        ("/v1/chat/completions/render", {"messages": []}, 400, "invalid_type"),
        ("/v1/completions/render", {"prompt": 7}, 400, "invalid_type"),
    ],
)
async def test_refusals_are_vllms(
    pod: SimulatedPod,
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    status: int,
    code: str,
) -> None:
    got, document, _ = await post(http, pod.url + path, body)
    assert (got, document["error"]["code"]) == (status, code)


async def test_a_prompt_over_max_model_len_is_refused_which_bounds_the_answer(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": "w " * (FAST.max_model_len + 1)}
    for path in ("/tokenize", "/v1/completions/render"):
        status, document, _ = await post(http, pod.url + path, body)
        assert status == 400
        assert "maximum context length" in document["error"]["message"]


async def test_only_a_vllm_flavoured_pod_serves_them(http: aiohttp.ClientSession) -> None:
    async with SimulatedPod("pod-s", profile=FAST, flavour=Flavour.SGLANG) as pod:
        for path in ("/tokenize", "/v1/chat/completions/render", "/v1/completions/render"):
            async with http.post(pod.url + path, json={"prompt": "x"}) as response:
                assert response.status == 404


def test_render_document_keeps_the_generate_request_fields() -> None:
    request = parse_completion_request(b'{"prompt": "a b", "max_tokens": 3}', chat=False)
    document = render_document(request, request_id="cmpl-1", model="m", max_tokens=3)
    assert set(document) == {
        "request_id",
        "token_ids",
        "features",
        "sampling_params",
        "model",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
    }
