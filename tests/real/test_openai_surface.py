"""The OpenAI Python SDK through the gateway to real vLLM pods: the model list, chat,
completions and the Responses API, plain and streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from tests.real.conftest import real_gateway
from tests.real.vllm_pods import MODEL, VllmPod

_EXACT = {"ignore_eos": True}  # vLLM's: exactly max_tokens, whatever the random model says


@pytest.fixture
async def client(pods: list[VllmPod], tmp_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with real_gateway(pods, tmp_path) as gateway:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60
        ) as sdk:
            yield sdk


async def test_models_chat_and_completions(client: openai.AsyncOpenAI) -> None:
    models = {model.id async for model in client.models.list()}
    assert {MODEL, "a", "b"} <= models, models
    chat = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello how are you"}],
        max_tokens=6,
        extra_body=_EXACT,
    )
    assert chat.model == MODEL
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    completion = await client.completions.create(
        model="a", prompt="hello there", max_tokens=5, extra_body=_EXACT
    )
    assert completion.model == "a"
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 5


async def test_streams_arrive_in_pieces_with_usage_last(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=_EXACT,
    )
    chunks = [chunk async for chunk in chat]
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    # vLLM may put two tokens in one event when the client reads behind; never all in one.
    assert 2 <= len(pieces) <= 6, chunks
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    completion = await client.completions.create(
        model="b",
        prompt="hello there",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=_EXACT,
    )
    parts = [chunk async for chunk in completion]
    texts = [c.choices[0].text for c in parts if c.choices and c.choices[0].text]
    assert 2 <= len(texts) <= 5, parts
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 5


async def test_responses_api_plain_and_streamed(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model=MODEL, input="hello how are you", max_output_tokens=6
    )
    assert response.model == MODEL
    assert response.output_text
    stream = await client.responses.create(
        model=MODEL, input="hello", max_output_tokens=6, stream=True
    )
    kinds = [event.type async for event in stream]
    assert kinds[0] == "response.created", kinds
    assert "response.output_text.delta" in kinds, kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
