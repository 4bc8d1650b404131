"""The OpenAI-compatible request and response documents a simulated pod speaks.

Shared by the pod's own HTTP handlers and the oracle router, which parses a request once
to choose a pod and then hands the parsed request to that pod in-process. Documents follow
vLLM's serialisation (compact JSON, `chat.completion.chunk` / `text_completion` objects,
`finish_reason` on the last content chunk, a final `choices: []` chunk carrying `usage` when
`stream_options.include_usage` is set, then `data: [DONE]`), so a client or a proxy sees
what it would see from vLLM.

Token rule (the simulator's): the prompt is every message's text joined by spaces, split on
whitespace; one word is one token. `token_ids` numbers those same tokens for `/tokenize` and
the render endpoints (`tokenize_document`, `render_document`), so a router that tokenizes
through the pod sees the prefix cache's own tokens: equal prefixes, equal leading ids.
Pure: no I/O.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llm_sim.kv_cache import Token

__all__ = [
    "BadRequestError",
    "CompletionRequest",
    "chunk_document",
    "completion_document",
    "error_document",
    "model_list_document",
    "parse_completion_request",
    "parse_tokenize_request",
    "render_document",
    "token_ids",
    "tokenize_document",
    "usage_chunk_document",
]


class BadRequestError(ValueError):
    """A request body the server refuses with 400; `code` is the OpenAI-style error code."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A parsed `/v1/chat/completions` (`chat`) or `/v1/completions` request, or a
    `/v1/responses` one (`responses`, with `chat`: responses_api).

    `model` is None when the body names none (vLLM then serves its base model);
    `max_tokens` is None when the body sets neither `max_tokens` nor
    `max_completion_tokens` (the pod applies its default). `body_bytes` is the body's size.
    """

    chat: bool
    model: str | None
    prompt: tuple[Token, ...]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    body_bytes: int = 0
    responses: bool = False


def _words(text: object, what: str) -> list[str]:
    if not isinstance(text, str):
        raise BadRequestError(f"{what} must be a string.", code="invalid_type")
    return text.split()


def _message_words(messages: object) -> list[str]:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError(
            "'messages' must be a non-empty list.", code="invalid_type", param="messages"
        )
    words: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequestError(
                "Each message must be an object.", code="invalid_type", param="messages"
            )
        content = message.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            words.extend(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type", "text") == "text":
                    words.extend(_words(part.get("text"), "A text part's 'text'"))
        else:
            raise BadRequestError(
                "A message's 'content' must be a string or a list of parts.",
                code="invalid_type",
                param="messages",
            )
    return words


def _prompt_words(prompt: object) -> list[Token]:
    if isinstance(prompt, str):
        return list[Token](prompt.split())
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return list[Token](prompt[0].split())
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)  # token ids: each id is one token
    raise BadRequestError(
        "'prompt' must be a string, a one-string list or a list of token ids.",
        code="invalid_type",
        param="prompt",
    )


def parse_completion_request(body: bytes, *, chat: bool) -> CompletionRequest:
    """Parse and validate a request body; raise BadRequestError for anything vLLM refuses."""
    try:
        document: Any = json.loads(body)
    except ValueError as exc:
        raise BadRequestError(f"The body is not valid JSON: {exc}.", code="invalid_json") from exc
    if not isinstance(document, dict):
        raise BadRequestError("The body must be a JSON object.", code="invalid_json")
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequestError("'model' must be a string.", code="invalid_type", param="model")
    prompt: list[Token]
    if chat:
        prompt = list(_message_words(document.get("messages")))
    else:
        if "prompt" not in document:
            raise BadRequestError("'prompt' is required.", code="missing_prompt", param="prompt")
        prompt = _prompt_words(document["prompt"])
    if not prompt:
        raise BadRequestError("The prompt is empty.", code="empty_prompt")
    max_tokens: int | None = None
    for key in ("max_completion_tokens", "max_tokens"):
        value = document.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequestError(f"'{key}' must be a positive integer.", param=key)
        max_tokens = value
        break
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean.", code="invalid_type", param="stream")
    options = document.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequestError(
            "'stream_options' must be an object.", code="invalid_type", param="stream_options"
        )
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:
        raise BadRequestError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    return CompletionRequest(
        chat=chat,
        model=model,
        prompt=tuple(prompt),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        body_bytes=len(body),
    )


def parse_tokenize_request(body: bytes) -> CompletionRequest:
    """Parse a `/tokenize` body: vLLM's chat form (`messages`) or completion form (`prompt`)."""
    try:
        document: Any = json.loads(body)
    except ValueError as exc:
        raise BadRequestError(f"The body is not valid JSON: {exc}.", code="invalid_json") from exc
    chat = isinstance(document, dict) and "messages" in document
    return parse_completion_request(body, chat=chat)


def token_ids(prompt: Sequence[Token]) -> list[int]:
    """The prompt's tokens as ids: an id stays itself, a word becomes its CRC-32.

    CRC-32 rather than `hash()`: ids must not depend on the process (pods, the router and
    tests see the same ids for the same word), as a real tokenizer's do not.
    """
    return [t if isinstance(t, int) else zlib.crc32(t.encode()) & 0x7FFFFFFF for t in prompt]


def tokenize_document(prompt: Sequence[Token], *, max_model_len: int) -> dict[str, Any]:
    """vLLM's `TokenizeResponse`: `count`, `max_model_len`, `tokens` (`token_strs` unset)."""
    ids = token_ids(prompt)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}


def render_document(
    request: CompletionRequest, *, request_id: str, model: str, max_tokens: int
) -> dict[str, Any]:
    """vLLM's `GenerateRequest`, what `/v1/chat/completions/render` answers (and each item of
    `/v1/completions/render`'s list): the prompt's token ids and its sampling parameters,
    reduced to those the simulator models (`max_tokens`)."""
    return {
        "request_id": request_id,
        "token_ids": token_ids(request.prompt),
        "features": None,
        "sampling_params": {"max_tokens": max_tokens},
        "model": model,
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.include_usage else None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
    }


def error_document(
    message: str, *, type: str, code: str, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def chunk_document(
    *,
    request_id: str,
    created: int,
    model: str,
    chat: bool,
    text: str,
    first: bool,
    finish_reason: str | None,
) -> str:
    """One streamed chunk's JSON (the `data:` payload), carrying `text`."""
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    if not chat:
        choice["stop_reason"] = None
    document: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return json.dumps(document, separators=(",", ":"))


def usage_chunk_document(
    *,
    request_id: str,
    created: int,
    model: str,
    chat: bool,
    prompt_tokens: int,
    completion_tokens: int,
) -> str:
    """The last chunk when `include_usage` is set: no choices, only usage."""
    document: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": _usage(prompt_tokens, completion_tokens),
    }
    return json.dumps(document, separators=(",", ":"))


def completion_document(
    *,
    request_id: str,
    created: int,
    model: str,
    chat: bool,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A non-streamed response body, with `usage`."""
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = None
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def model_list_document(
    *, base_model: str, adapters: Sequence[str], created: int, max_model_len: int
) -> dict[str, Any]:
    """`/v1/models` as vLLM lists it: the base model, then each LoRA adapter as a child."""
    data: list[dict[str, Any]] = [
        {
            "id": base_model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": base_model,
            "parent": None,
            "max_model_len": max_model_len,
        }
    ]
    data.extend(
        {
            "id": adapter,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": f"/adapters/{adapter}",
            "parent": base_model,
            "max_model_len": None,
        }
        for adapter in adapters
    )
    return {"object": "list", "data": data}
