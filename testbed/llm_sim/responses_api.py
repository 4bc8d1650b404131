"""The Responses API (`/v1/responses`) and the embeddings API (`/v1/embeddings`) as a
simulated pod speaks them: request parsing and response documents. Pure: no I/O.

Responses. A request's `input` (a string, or a list of messages whose content is a string
or `input_text` / `output_text` parts) and its `instructions` make the prompt by the
simulator's token rule (openai_api); `max_output_tokens` bounds the output. It runs on the
engine like a chat completion. The simulator ends every generation at its token limit, so a
response is `incomplete` (`incomplete_details.reason: max_output_tokens`), as OpenAI and
vLLM report a generation cut there. Streamed, it is OpenAI's event sequence, each event an
SSE `event: <type>` line and its `data:` (vLLM's framing, no `[DONE]`): `response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` per chunk, then the `.done` events and `response.completed`
with the final response, whatever its status (as vLLM and SGLang end a stream, and what the
SDK's `responses.stream()` waits for), `sequence_number` counting from 0. Stored responses
(`GET /v1/responses/{id}`) are not kept.

Embeddings. Any model a pod serves answers (the simulator has no separate embedding
models): the vector is a bag of the input's tokens, each token adding ±1 to one of
`dimensions` (EMBEDDING_DIMENSIONS unless the request asks) coordinates by its id, then
scaled to length 1. Equal inputs give equal vectors, and inputs sharing words point the
same way. `encoding_format` `float` (a list) or `base64` (little-endian float32, what the
OpenAI SDK asks for by default and decodes). An embedding is answered at once, outside the
engine: it takes no batch seat and no KV blocks.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from llm_sim.kv_cache import Token
from llm_sim.openai_api import BadRequestError, CompletionRequest, token_ids

__all__ = [
    "EMBEDDING_DIMENSIONS",
    "EmbeddingRequest",
    "ResponseEvents",
    "embedding",
    "embeddings_document",
    "parse_embedding_request",
    "parse_responses_request",
    "response_document",
]

EMBEDDING_DIMENSIONS = 16
_MAX_DIMENSIONS = 8192


def _object(body: bytes) -> dict[str, Any]:
    try:
        document: Any = json.loads(body)
    except ValueError as exc:
        raise BadRequestError(f"The body is not valid JSON: {exc}.", code="invalid_json") from exc
    if not isinstance(document, dict):
        raise BadRequestError("The body must be a JSON object.", code="invalid_json")
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequestError("'model' must be a string.", code="invalid_type", param="model")
    return document


def _input_words(value: object) -> list[str]:
    """The words of a Responses `input`: a string, or messages with string or part content."""
    if isinstance(value, str):
        return value.split()
    if not isinstance(value, list):
        raise BadRequestError(
            "'input' must be a string or a list of items.", code="invalid_type", param="input"
        )
    words: list[str] = []
    for item in value:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, str):
            words.extend(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    words.extend(part["text"].split())
        elif not isinstance(item, dict):
            raise BadRequestError(
                "Each input item must be an object.", code="invalid_type", param="input"
            )
    return words


def _positive(document: dict[str, Any], key: str) -> int | None:
    value = document.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequestError(f"'{key}' must be a positive integer.", param=key)
    return value


def parse_responses_request(body: bytes) -> CompletionRequest:
    """A `/v1/responses` body as the engine's request (`responses` set); raise
    BadRequestError for what vLLM refuses."""
    document = _object(body)
    if "input" not in document:
        raise BadRequestError("'input' is required.", code="missing_input", param="input")
    instructions = document.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequestError(
            "'instructions' must be a string.", code="invalid_type", param="instructions"
        )
    words = (instructions or "").split() + _input_words(document["input"])
    if not words:
        raise BadRequestError("The input is empty.", code="empty_prompt", param="input")
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean.", code="invalid_type", param="stream")
    return CompletionRequest(
        chat=True,
        responses=True,
        model=document.get("model"),
        prompt=tuple(words),
        max_tokens=_positive(document, "max_output_tokens"),
        stream=stream,
        include_usage=False,
        body_bytes=len(body),
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The output message; `text` None: not begun (no content part yet)."""
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_text_part(text)],
    }


def response_document(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str | None,
    finished: bool,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """OpenAI's Response object: in progress (`text` None, no output yet), or done with
    `text`, `incomplete` unless the generation `finished` on its own (module docstring)."""
    status = "in_progress" if text is None else ("completed" if finished else "incomplete")
    output = [] if text is None else [_message(f"msg_{request_id}", text, status)]
    return {
        "id": request_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": None if text is None else _usage(prompt_tokens, completion_tokens),
        "metadata": {},
    }


class ResponseEvents:
    """The SSE frames of one streamed response, in OpenAI's order (module docstring).

    Mutable state: `_sequence` (the next event's number) and `_text` (the text so far).
    """

    def __init__(self, *, request_id: str, created: int, model: str) -> None:
        self._request_id = request_id
        self._created = created
        self._model = model
        self._item = f"msg_{request_id}"
        self._sequence = 0
        self._text = ""

    def _frame(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(event, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _response(self, text: str | None, *, finished: bool, usage: tuple[int, int]) -> Any:
        return response_document(
            request_id=self._request_id,
            created=self._created,
            model=self._model,
            text=text,
            finished=finished,
            prompt_tokens=usage[0],
            completion_tokens=usage[1],
        )

    def opening(self) -> list[bytes]:
        """The events before the first token."""
        begun = self._response(None, finished=False, usage=(0, 0))
        at = {"item_id": self._item, "output_index": 0, "content_index": 0}
        return [
            self._frame("response.created", response=begun),
            self._frame("response.in_progress", response=begun),
            self._frame(
                "response.output_item.added",
                output_index=0,
                item=_message(self._item, None, "in_progress"),
            ),
            self._frame("response.content_part.added", **at, part=_text_part("")),
        ]

    def delta(self, text: str) -> bytes:
        """One `response.output_text.delta` with the chunk's `text`."""
        self._text += text
        at = {"item_id": self._item, "output_index": 0, "content_index": 0}
        return self._frame("response.output_text.delta", **at, delta=text, logprobs=[])

    def closing(self, *, prompt_tokens: int, completion_tokens: int) -> list[bytes]:
        """The events after the last token: the `.done` events and the final response."""
        done = self._response(
            self._text, finished=False, usage=(prompt_tokens, completion_tokens)
        )
        (item,) = done["output"]
        at = {"item_id": self._item, "output_index": 0, "content_index": 0}
        return [
            self._frame("response.output_text.done", **at, text=self._text, logprobs=[]),
            self._frame("response.content_part.done", **at, part=_text_part(self._text)),
            self._frame("response.output_item.done", output_index=0, item=item),
            self._frame("response.completed", response=done),
        ]


@dataclass(frozen=True, kw_only=True)
class EmbeddingRequest:
    """A parsed `/v1/embeddings` request: one token list per input."""

    model: str | None
    inputs: tuple[tuple[Token, ...], ...]
    dimensions: int
    base64: bool


def _embedding_input(value: object) -> list[tuple[Token, ...]]:
    """`input` as token lists: a string, a list of strings, a list of token ids, or a list
    of such lists."""

    def ids(item: object) -> bool:
        return isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        )

    if isinstance(value, str):
        return [tuple(value.split())]
    if ids(value) and value:
        return [tuple(value)]  # type: ignore[arg-type]
    if isinstance(value, list) and value and all(isinstance(v, str) or ids(v) for v in value):
        return [tuple(v.split()) if isinstance(v, str) else tuple(v) for v in value]
    raise BadRequestError(
        "'input' must be a string, a list of strings, or token ids.",
        code="invalid_type",
        param="input",
    )


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """A `/v1/embeddings` body; raise BadRequestError for what vLLM refuses."""
    document = _object(body)
    if "input" not in document:
        raise BadRequestError("'input' is required.", code="missing_input", param="input")
    inputs = _embedding_input(document["input"])
    if not all(inputs):
        raise BadRequestError("An input is empty.", code="empty_prompt", param="input")
    encoding = document.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequestError(
            "'encoding_format' must be 'float' or 'base64'.", param="encoding_format"
        )
    dimensions = _positive(document, "dimensions") or EMBEDDING_DIMENSIONS
    if dimensions > _MAX_DIMENSIONS:
        raise BadRequestError(
            f"'dimensions' must be at most {_MAX_DIMENSIONS}.", param="dimensions"
        )
    return EmbeddingRequest(
        model=document.get("model"),
        inputs=tuple(inputs),
        dimensions=dimensions,
        base64=encoding == "base64",
    )


def embedding(tokens: tuple[Token, ...], dimensions: int) -> list[float]:
    """The unit vector of `tokens` (module docstring); all zeros if they cancel out."""
    vector = [0.0] * dimensions
    for token_id in token_ids(tokens):
        vector[token_id % dimensions] += 1.0 if (token_id >> 16) & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector] if norm else vector


def embeddings_document(
    request: EmbeddingRequest, *, request_id: str, created: int, model: str
) -> dict[str, Any]:
    """vLLM's embedding response: one `embedding` object per input, and `usage`."""
    data = []
    for index, tokens in enumerate(request.inputs):
        vector = embedding(tokens, request.dimensions)
        encoded: list[float] | str = vector
        if request.base64:
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"index": index, "object": "embedding", "embedding": encoded})
    total = sum(len(t) for t in request.inputs)
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
    }
