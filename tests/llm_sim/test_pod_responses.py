"""The Responses API and embeddings on a simulated pod, read by the OpenAI Python SDK as a
user's code reads them (responses_api)."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from llm_sim.pod import BACKEND_ID_HEADER, DEFAULT_MODEL, SimulatedPod
from llm_sim.profiles import H100
from llm_sim.responses_api import EMBEDDING_DIMENSIONS, embedding

FAST = H100.scaled(0.1)


@pytest.fixture
async def pod() -> AsyncIterator[SimulatedPod]:
    async with SimulatedPod("pod-a", profile=FAST, adapters=("sql-lora",)) as pod:
        yield pod


@pytest.fixture
async def client(pod: SimulatedPod) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{pod.url}/v1", api_key="not-checked", max_retries=0
    ) as client:
        yield client


async def test_a_response_is_openais_shape(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model=DEFAULT_MODEL, input="one two three", max_output_tokens=4
    )
    assert response.object == "response"
    assert response.id.startswith("resp-pod-a-")
    assert response.model == DEFAULT_MODEL
    assert len(response.output_text.split()) == 4
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    # Every generation ends at its token limit: cut there, as OpenAI reports it.
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (3, 4)
    assert response.usage.total_tokens == 7


async def test_instructions_and_message_input_make_the_prompt(
    client: openai.AsyncOpenAI,
) -> None:
    response = await client.responses.create(
        model="sql-lora",
        instructions="be brief",
        input=[
            {"role": "user", "content": "a b"},
            {"role": "user", "content": [{"type": "input_text", "text": "c"}]},
        ],
        max_output_tokens=2,
    )
    assert response.model == "sql-lora"
    assert response.usage is not None and response.usage.input_tokens == 5


async def test_a_streamed_response_is_openais_event_sequence(
    client: openai.AsyncOpenAI, pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    stream = await client.responses.create(
        model=DEFAULT_MODEL, input="hello there", max_output_tokens=5, stream=True
    )
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 5  # one token per chunk (stream_interval 1)
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",  # with the final response, incomplete here
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and len(text.split()) == 5
    assert final.status == "incomplete"
    assert final.usage is not None and final.usage.output_tokens == 5

    # The wire: vLLM's framing, an `event:` line per event and no `[DONE]`.
    body = {"model": DEFAULT_MODEL, "input": "x", "max_output_tokens": 1, "stream": True}
    async with http.post(pod.url + "/v1/responses", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers[BACKEND_ID_HEADER] == "pod-a"
        raw = (await response.read()).decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and "[DONE]" not in raw
    assert frames[0].startswith("event: response.created\ndata: {")


async def test_the_sdks_stream_helper_accumulates_the_text(client: openai.AsyncOpenAI) -> None:
    async with client.responses.stream(
        model=DEFAULT_MODEL, input="a b c", max_output_tokens=3
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert len(final.output_text.split()) == 3


async def test_embeddings_of_any_served_model(client: openai.AsyncOpenAI) -> None:
    # The SDK asks for base64 and decodes it unless told otherwise.
    result = await client.embeddings.create(
        model=DEFAULT_MODEL, input=["the cat sat", "the cat sat", "a dog ran far"]
    )
    assert result.model == DEFAULT_MODEL
    vectors = [d.embedding for d in result.data]
    assert [d.index for d in result.data] == [0, 1, 2]
    assert all(len(v) == EMBEDDING_DIMENSIONS for v in vectors)
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-5) for v in vectors)
    assert vectors[0] == vectors[1] != vectors[2]
    assert result.usage.prompt_tokens == 10
    floats = await client.embeddings.create(
        model="sql-lora", input="the cat sat", encoding_format="float", dimensions=8
    )
    assert floats.data[0].embedding == pytest.approx(embedding(("the", "cat", "sat"), 8))


async def test_embeddings_base64_is_little_endian_float32(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    body = {"input": [1, 2, 3], "encoding_format": "base64"}
    async with http.post(pod.url + "/v1/embeddings", json=body) as response:
        document: Any = await response.json()
    assert document["model"] == DEFAULT_MODEL  # no model: the base model, as vLLM does
    raw = base64.b64decode(document["data"][0]["embedding"])
    decoded = struct.unpack(f"<{EMBEDDING_DIMENSIONS}f", raw)
    assert decoded == pytest.approx(embedding((1, 2, 3), EMBEDDING_DIMENSIONS))


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/responses", {"model": DEFAULT_MODEL}, 400, "missing_input"),
        ("/v1/responses", {"input": "x", "max_output_tokens": 0}, 400, "invalid_request"),
        ("/v1/responses", {"model": "nope", "input": "x"}, 404, "model_not_found"),
        ("/v1/embeddings", {"input": []}, 400, "invalid_type"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 400, "invalid_request"),
        ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "model_not_found"),
    ],
)
async def test_bad_requests_are_openai_errors(
    pod: SimulatedPod,
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    status: int,
    code: str,
) -> None:
    async with http.post(pod.url + path, json=body) as response:
        assert response.status == status
        assert (await response.json())["error"]["code"] == code
