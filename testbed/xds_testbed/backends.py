"""Small OpenAI-compatible model servers for the local demo and the tests.

Just enough of the API for Envoy's routing to be observable: chat and text completions
(JSON, or server-sent events with `"stream": true`), the model list and a health check.
Every response names the backend in `x-backend-id`, and every request is recorded (one on
a path it does not serve too, refused with a 404), so a test can tell which endpoint served
it and what arrived (headers, body size). The GPU simulator that makes balancing results
meaningful lives in bench/; this is not it.

Token counts follow the simulator's rule: one whitespace-separated word is one token.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiohttp import web

__all__ = ["BACKEND_ID_HEADER", "BackendState", "ExampleBackend", "RecordedRequest"]

logger = logging.getLogger(__name__)

BACKEND_ID_HEADER = "x-backend-id"

# Prompts can be many megabytes; aiohttp refuses bodies over 1 MiB by default.
_MAX_BODY_BYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class RecordedRequest:
    """What one request looked like when it reached the backend."""

    method: str
    path: str
    headers: Mapping[str, str]
    body_size: int
    model: str | None


class BackendState(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class ExampleBackend:
    """An OpenAI-compatible server on 127.0.0.1 and a free port, as an async context manager.

    `tokens` is the completion length unless the request sets `max_tokens` (or
    `max_completion_tokens`); streamed tokens are `token_delay` seconds apart. When `hold`
    is given, a streamed response sends its first chunk and then waits for `hold` to be
    set before sending the rest, so a test can see the first chunk arrive while the
    response is still unfinished.

    Mutable state: `requests` (appended per request), `streams_started` and
    `streams_finished` (counted per streamed response) and the aiohttp runner.
    """

    def __init__(
        self,
        *,
        backend_id: str,
        models: Sequence[str] = ("example-model",),
        tokens: int = 8,
        token_delay: float = 0.0,
        hold: asyncio.Event | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.backend_id = backend_id
        self.models = tuple(models)
        self.tokens = tokens
        self.token_delay = token_delay
        self.hold = hold
        self.state = BackendState.UNOPENED
        self.requests: list[RecordedRequest] = []
        self.streams_started = 0
        self.streams_finished = 0
        self._host = host
        self._port = port
        self._bound_port: int | None = None
        self._runner: web.AppRunner | None = None
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return (
            f"<ExampleBackend {self.backend_id} state={self.state.value} "
            f"port={self._bound_port} requests={len(self.requests)}>"
        )

    async def __aenter__(self) -> ExampleBackend:
        if self.state is not BackendState.UNOPENED:
            raise RuntimeError(f"Cannot start an ExampleBackend that is {self.state.value}.")
        self.state = BackendState.OPEN
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        # Anything else is recorded too (and refused): a test sees every request that
        # reached the backend, on whatever path.
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        self._bound_port = int(self._runner.addresses[0][1])
        logger.info("Backend %s listening on %s:%d.", self.backend_id, self._host, self.port)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.state = BackendState.CLOSED
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The bound port."""
        if self._bound_port is None:
            raise RuntimeError("The ExampleBackend has not been started; use `async with`.")
        return self._bound_port

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def request_count(self) -> int:
        return len(self.requests)

    @property
    def last_request(self) -> RecordedRequest:
        if not self.requests:
            raise LookupError(f"Backend {self.backend_id} has received no request.")
        return self.requests[-1]

    @property
    def last_headers(self) -> Mapping[str, str]:
        return self.last_request.headers

    # -- handlers ------------------------------------------------------------------------

    def _headers(self, **extra: str) -> dict[str, str]:
        return {BACKEND_ID_HEADER: self.backend_id, **extra}

    def _record(self, request: web.Request, body: bytes, model: str | None) -> None:
        self.requests.append(
            RecordedRequest(
                method=request.method,
                path=request.path,
                headers={k.lower(): v for k, v in request.headers.items()},
                body_size=len(body),
                model=model,
            )
        )

    async def _other(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self._record(request, raw, None)
        error = {"message": f"No {request.method} {request.path} here.", "type": "not_found"}
        return web.json_response({"error": error}, status=404, headers=self._headers())

    async def _health(self, request: web.Request) -> web.Response:
        self._record(request, b"", None)
        return web.Response(text="ok", headers=self._headers())

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request, b"", None)
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": self.backend_id}
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": data}, headers=self._headers())

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        self._record(request, raw, model if isinstance(model, str) else None)
        if not isinstance(body, dict):
            error = {"message": "Invalid JSON body.", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400, headers=self._headers())
        chat = request.path.endswith("/chat/completions")
        completion_tokens = int(
            body.get("max_completion_tokens") or body.get("max_tokens") or self.tokens
        )
        usage = {
            "prompt_tokens": _count_prompt_tokens(body),
            "completion_tokens": completion_tokens,
        }
        usage["total_tokens"] = usage["prompt_tokens"] + completion_tokens
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{self.backend_id}-{next(self._ids)}"
        common = {"id": ident, "created": int(time.time()), "model": model}
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return await self._stream(
                request,
                common,
                chat=chat,
                tokens=completion_tokens,
                usage=usage if options.get("include_usage") else None,
            )
        text = " ".join(_token(i) for i in range(completion_tokens))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        document = {
            **common,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": usage,
        }
        return web.json_response(document, headers=self._headers())

    async def _stream(
        self,
        request: web.Request,
        common: dict[str, Any],
        *,
        chat: bool,
        tokens: int,
        usage: dict[str, int] | None,
    ) -> web.StreamResponse:
        self.streams_started += 1
        response = web.StreamResponse(
            headers=self._headers(
                **{"content-type": "text/event-stream", "cache-control": "no-cache"}
            )
        )
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def send(document: dict[str, Any] | str) -> None:
            data = document if isinstance(document, str) else json.dumps(document)
            await response.write(f"data: {data}\n\n".encode())

        for i in range(tokens):
            if i == 1 and self.hold is not None:
                await self.hold.wait()
            if i > 0 and self.token_delay > 0:
                await asyncio.sleep(self.token_delay)
            last = i == tokens - 1
            text = _token(i) + ("" if last else " ")
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": "length" if last else None,
                "logprobs": None,
            }
            if chat:
                choice["delta"] = (
                    {"role": "assistant", "content": text} if i == 0 else {"content": text}
                )
            else:
                choice["text"] = text
            await send({**common, "object": kind, "choices": [choice]})
        if usage is not None:
            await send({**common, "object": kind, "choices": [], "usage": usage})
        await send("[DONE]")
        await response.write_eof()
        self.streams_finished += 1
        return response


def _token(i: int) -> str:
    return f"tok{i}"


def _count_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Whitespace words in `prompt` or in the messages' text content."""
    texts: list[str] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        texts.extend(p for p in prompt if isinstance(p, str))
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return sum(len(t.split()) for t in texts)
