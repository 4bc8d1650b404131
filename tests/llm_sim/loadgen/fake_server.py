"""A small vLLM-like SSE server whose behaviour each request chooses, for the replay tests.

The `x-test-action` request header picks the behaviour: stream normally (no header), refuse
with 429 (with or without Retry-After) or 503, reset the connection mid-stream, end the
stream without `[DONE]`, hang, or report a usage that differs from the streamed words (so a
test can tell which one the replayer used). Streams follow vLLM: a role-only first chunk,
one chunk per token (`"w<i> "`), a usage chunk with `choices: []` when
`stream_options.include_usage` is set, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiohttp import web

ACTION_HEADER = "x-test-action"


@dataclass(frozen=True)
class Arrival:
    at: float
    headers: dict[str, str]
    body: dict[str, Any]


class FakeServer:
    """Mutable state: `arrivals` (one per request), `in_flight` and `max_in_flight`."""

    def __init__(
        self, *, first_token_delay: float = 0.0, token_delay: float = 0.0, backend_id: str = "b0"
    ) -> None:
        self.first_token_delay = first_token_delay
        self.token_delay = token_delay
        self.backend_id = backend_id
        self.arrivals: list[Arrival] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._closing = asyncio.Event()

    async def __aenter__(self) -> FakeServer:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = int(self._runner.addresses[0][1])
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._runner is not None
        self._closing.set()  # releases hanging handlers, which cleanup() waits for
        await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        body = json.loads(await request.read())
        self.arrivals.append(
            Arrival(loop.time(), {k.lower(): v for k, v in request.headers.items()}, body)
        )
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._respond(request, body, request.headers.get(ACTION_HEADER, ""))
        finally:
            self.in_flight -= 1

    async def _respond(
        self, request: web.Request, body: dict[str, Any], action: str
    ) -> web.StreamResponse:
        ident = {"x-backend-id": self.backend_id}
        if action == "429-retry":
            error = {"message": "Pool saturated.", "type": "rate_limit", "code": "pool_saturated"}
            return web.json_response(
                {"error": error}, status=429, headers={**ident, "retry-after": "2"}
            )
        if action == "429":
            error = {"message": "Too many.", "type": "rate_limit", "code": "rate_limited"}
            return web.json_response({"error": error}, status=429, headers=ident)
        if action == "503":
            return web.Response(status=503, text="no healthy upstream", headers=ident)
        if action == "hang":
            await self._closing.wait()
            return web.Response(status=500, headers=ident)
        tokens = int(body["max_tokens"])
        if not body.get("stream"):
            await asyncio.sleep(self.first_token_delay)
            text = " ".join(f"w{i}" for i in range(tokens))
            document = {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": 1},
            }
            return web.json_response(document, headers=ident)
        response = web.StreamResponse(headers={**ident, "content-type": "text/event-stream"})
        await response.prepare(request)

        async def send(data: Any) -> None:
            line = data if isinstance(data, str) else json.dumps(data)
            await response.write(f"data: {line}\n\n".encode())

        common = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": body["model"]}
        delta = {"role": "assistant", "content": ""}
        await send({**common, "choices": [{"index": 0, "delta": delta}]})
        await asyncio.sleep(self.first_token_delay)
        words = 0
        for i in range(tokens):
            if i > 0:
                await asyncio.sleep(self.token_delay)
            # With "two-words" the first chunk carries two words, so words != chunks.
            text = f"w{i} x{i} " if action == "two-words" and i == 0 else f"w{i} "
            words += len(text.split())
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            await send({**common, "choices": [choice]})
            if action == "reset":
                assert request.transport is not None
                request.transport.close()
                return response
        if (body.get("stream_options") or {}).get("include_usage"):
            completion = 99 if action == "usage-lies" else words
            usage = {"prompt_tokens": 1, "completion_tokens": completion, "total_tokens": 1}
            await send({**common, "choices": [], "usage": usage})
        if action != "no-done":
            await send("[DONE]")
        await response.write_eof()
        return response
