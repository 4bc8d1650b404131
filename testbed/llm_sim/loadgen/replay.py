"""The open-loop replayer: send a trace's requests on schedule and measure each one.

Open loop, because that is how users arrive: request i is sent at `start + at_s ·
time_scale` on the event loop's monotonic clock whether or not earlier requests have
finished. A closed-loop client (next request when the last one returns) slows down exactly
when the system under test does, hiding the queueing that the balancing policies are
meant to avoid. The only brake is `max_in_flight`, a safety cap: a request due while that
many are open is not delayed but recorded as `dropped_by_client`, so the schedule (and
every other policy's comparison) stays intact and the report shows the overload.

The generator checks its own health, because a late generator looks like a slow server.
A probe task sleeps 10 ms in a loop and records how late it wakes (event-loop lag), and
every request records how late it was sent. When either p99 exceeds
`SATURATION_THRESHOLD_S` (50 ms: a few decode steps of a simulated pod, and about a tenth
of the TTFTs the scenarios compare), the result is flagged `saturated`. The benchmark runs
the generator in its own process (`process.run_replay_in_subprocess`) so the simulated
pods' event loop and this one do not steal time from each other.

SSE is parsed cheaply: the body is split into lines as bytes; a chunk's `delta.content` string is
decoded on its own (no full JSON parse) to count words and spot the first token, and only
the usage chunk (it names `completion_tokens`) is parsed as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from llm_sim.loadgen.results import OK_STATUS, ErrorKind, ReplayResult, RequestResult
from llm_sim.loadgen.stats import percentile
from llm_sim.loadgen.trace import Trace, TraceRequest

__all__ = [
    "BACKEND_ID_HEADER",
    "DEFAULT_BAND_HEADER",
    "HeadersFor",
    "LAG_PROBE_INTERVAL_S",
    "SATURATION_THRESHOLD_S",
    "SESSION_HEADER",
    "replay",
]

logger = logging.getLogger(__name__)

# Send lateness p99 or event-loop lag p99 above this marks the generator as the bottleneck.
SATURATION_THRESHOLD_S = 0.05
LAG_PROBE_INTERVAL_S = 0.01
# The flow-control band's header (the default of `flow_control.band_header`).
DEFAULT_BAND_HEADER = "x-gateway-inference-band"
SESSION_HEADER = "x-session-id"
BACKEND_ID_HEADER = "x-backend-id"
_RETRY_AFTER = "retry-after"
_CHAT_PATH = "/v1/chat/completions"
# Enough of a refusal's body to find its error code; the rest is not read.
_MAX_ERROR_BODY = 64 * 1024
# Time between starting the replay and the trace's offset 0, so that the first requests
# are not late merely because the session and the lag probe were being set up.
_START_DELAY_S = 0.05

HeadersFor = Callable[[TraceRequest], Mapping[str, str]]

_DECODER = json.JSONDecoder()
_CONTENT_KEY_TEXT = '"content":'
_CONTENT_KEY = _CONTENT_KEY_TEXT.encode()
_USAGE_MARK = b'"completion_tokens"'
_DONE = b"[DONE]"


async def replay(
    trace: Trace,
    *,
    url: str,
    timeout_s: float,
    max_in_flight: int,
    headers_for: HeadersFor | None = None,
    time_scale: float = 1.0,
    stream_options_usage: bool = True,
    band_header: str = DEFAULT_BAND_HEADER,
    prompt_salt: str = "",
    extra_body: Mapping[str, Any] | None = None,
    cache_key_session: bool = False,
) -> ReplayResult:
    """Replay `trace` against the OpenAI-compatible server at `url` (scheme, host, port).

    Each request is a POST to `/v1/chat/completions` with the trace's model, prompt,
    `max_tokens` and `stream`, `stream_options.include_usage` unless
    `stream_options_usage` is False, `user` and `x-session-id` set to the session (when the
    request has one; else `user` to the request's user, if any), the band in
    `band_header`, then the headers `headers_for(request)` returns and the fields of
    `extra_body` (e.g. `{"ignore_eos": True}` for a real vLLM). With `cache_key_session`, a
    request with a prefix group and no session also carries its `prompt_cache_key` in
    `x-session-id`, where a router that does not read the body's key (vllm-router) finds it; the
    trace and every body are unchanged.
    `timeout_s` bounds each request from send to last byte; `time_scale` stretches (> 1)
    or compresses (< 1) the schedule. Returns when every request has finished.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    if time_scale <= 0 or timeout_s <= 0:
        raise ValueError("time_scale and timeout_s must be positive")
    loop = asyncio.get_running_loop()
    cpu_before = time.process_time()
    connector = aiohttp.TCPConnector(limit=max_in_flight, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sender = _Sender(
            session=session,
            endpoint=url.rstrip("/") + _CHAT_PATH,
            stream=trace.spec.stream,
            usage=stream_options_usage,
            band_header=band_header,
            headers_for=headers_for,
            salt=prompt_salt,
            extra_body=dict(extra_body or {}),
            cache_key_session=cache_key_session,
            start=loop.time() + _START_DELAY_S,
        )
        started_at_unix = time.time() + (sender.start - loop.time())
        probe = _LagProbe()
        probe_task = asyncio.create_task(probe.run(), name="loadgen-lag-probe")
        try:
            await sender.send_all(
                trace.requests, time_scale=time_scale, max_in_flight=max_in_flight
            )
        finally:
            probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe_task
        duration = loop.time() - sender.start
    results = tuple(sorted(sender.results, key=lambda r: r.index))
    lateness = percentile((r.lateness_s for r in results), 99) or 0.0
    lag_p99 = percentile(probe.samples, 99) or 0.0
    result = ReplayResult(
        url=url,
        trace_seed=trace.seed,
        started_at_unix=started_at_unix,
        time_scale=time_scale,
        max_in_flight=max_in_flight,
        duration_s=duration,
        results=results,
        loop_lag_p50_s=percentile(probe.samples, 50) or 0.0,
        loop_lag_p99_s=lag_p99,
        loop_lag_max_s=max(probe.samples, default=0.0),
        send_lateness_p99_s=lateness,
        saturated=lateness > SATURATION_THRESHOLD_S or lag_p99 > SATURATION_THRESHOLD_S,
        cpu_s=time.process_time() - cpu_before,
        metadata={"band_header": band_header, "prompt_salt": prompt_salt},
    )
    if result.saturated:
        logger.warning(
            "The load generator was saturated (send lateness p99 %.3f s, loop lag p99 %.3f s);"
            " latencies of this run are not trustworthy.",
            lateness,
            lag_p99,
        )
    return result


class _LagProbe:
    """Measures event-loop lag. Mutable state: `samples` (seconds late, one per wake-up)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_PROBE_INTERVAL_S)
            self.samples.append(max(0.0, loop.time() - before - LAG_PROBE_INTERVAL_S))


@dataclass(kw_only=True)
class _Stream:
    """What has been seen of one streamed response so far."""

    first_token_at: float | None = None
    words: int = 0
    usage_tokens: int | None = None
    done_at: float | None = None


class _Sender:
    """Sends requests on schedule. Mutable state: `results` (appended as requests end) and
    `in_flight` (requests sent and not yet finished)."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        endpoint: str,
        stream: bool,
        usage: bool,
        band_header: str,
        headers_for: HeadersFor | None,
        salt: str,
        extra_body: dict[str, Any],
        cache_key_session: bool,
        start: float,
    ) -> None:
        self.session = session
        self.endpoint = endpoint
        self.stream = stream
        self.usage = usage
        self.band_header = band_header
        self.headers_for = headers_for
        self.salt = salt
        self.extra_body = extra_body
        self.cache_key_session = cache_key_session
        self.start = start
        self.results: list[RequestResult] = []
        self.in_flight = 0

    async def send_all(
        self, requests: Sequence[TraceRequest], *, time_scale: float, max_in_flight: int
    ) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as group:
            for request in requests:
                scheduled = request.at_s * time_scale
                due = self.start + scheduled
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.in_flight >= max_in_flight:
                    self.results.append(
                        RequestResult(
                            index=request.index,
                            band=request.band,
                            model=request.model,
                            scheduled_at_s=scheduled,
                            lateness_s=loop.time() - due,
                            status=None,
                            error=ErrorKind.DROPPED_BY_CLIENT,
                        )
                    )
                    continue
                self.in_flight += 1
                group.create_task(self._send(request, scheduled))

    async def _send(self, request: TraceRequest, scheduled: float) -> None:
        try:
            result = await self._exchange(request, scheduled)
        finally:
            self.in_flight -= 1
        self.results.append(result)

    def _request(self, request: TraceRequest) -> tuple[bytes, dict[str, str]]:
        body: dict[str, Any] = {
            "model": request.model,
            "messages": [{"role": "user", "content": request.prompt_text(salt=self.salt)}],
            "max_tokens": request.max_tokens,
            "stream": self.stream,
        }
        if self.stream and self.usage:
            body["stream_options"] = {"include_usage": True}
        if request.session is not None:
            body["user"] = request.session
        elif request.user is not None:
            body["user"] = request.user
        cache_key = None if request.prefix_group is None else f"prefix-{request.prefix_group}"
        if cache_key is not None:
            # What a client sharing a system prompt sets for cache-friendly routing (OpenAI's
            # `prompt_cache_key`); the model server ignores it.
            body["prompt_cache_key"] = cache_key
        body.update(self.extra_body)
        headers = {"content-type": "application/json", self.band_header: request.band}
        if request.session is not None:
            headers[SESSION_HEADER] = request.session
        elif self.cache_key_session and cache_key is not None:
            headers[SESSION_HEADER] = cache_key
        if self.headers_for is not None:
            headers.update(self.headers_for(request))
        return json.dumps(body).encode(), headers

    async def _exchange(self, request: TraceRequest, scheduled: float) -> RequestResult:
        loop = asyncio.get_running_loop()
        due = self.start + scheduled
        body, headers = self._request(request)
        sent = loop.time()
        status: int | None = None
        backend: str | None = None
        seen = _Stream()
        error: ErrorKind | None = None
        try:
            async with self.session.post(self.endpoint, data=body, headers=headers) as response:
                status = response.status
                backend = response.headers.get(BACKEND_ID_HEADER)
                if status != OK_STATUS:
                    raw = await response.content.read(_MAX_ERROR_BODY)
                    is_json = response.content_type == "application/json"
                    return RequestResult(
                        index=request.index,
                        band=request.band,
                        model=request.model,
                        scheduled_at_s=scheduled,
                        lateness_s=sent - due,
                        status=status,
                        e2e_s=loop.time() - sent,
                        backend_id=backend,
                        retry_after=response.headers.get(_RETRY_AFTER),
                        error_code=_error_code(raw),
                        error_json=is_json and _parses(raw),
                    )
                if self.stream:
                    await _read_stream(response, seen, loop.time)
                else:
                    _read_completion(await response.read(), seen, loop.time())
                if seen.done_at is None:
                    error = ErrorKind.INCOMPLETE
        except Exception as exc:
            error = _error_kind(exc)
            if error is None:
                raise
            if seen.done_at is not None:
                error = None  # the response was complete; only the drain after it failed
        end = seen.done_at if seen.done_at is not None else loop.time()
        tokens = seen.usage_tokens if seen.usage_tokens is not None else seen.words
        ttft = None if seen.first_token_at is None else seen.first_token_at - sent
        e2e = end - sent
        tpot = None
        if ttft is not None and tokens > 1:
            tpot = (e2e - ttft) / (tokens - 1)
        return RequestResult(
            index=request.index,
            band=request.band,
            model=request.model,
            scheduled_at_s=scheduled,
            lateness_s=sent - due,
            status=status,
            error=error,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=e2e,
            output_tokens=tokens,
            backend_id=backend,
        )


def _error_kind(exc: Exception) -> ErrorKind | None:
    """The kind of a transport failure; None for an exception that is a bug here."""
    if isinstance(exc, TimeoutError):  # aiohttp's timeouts subclass it
        return ErrorKind.TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ErrorKind.CONNECT
    if isinstance(
        exc,
        aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError | aiohttp.ClientOSError,
    ) or isinstance(exc, ConnectionError):
        return ErrorKind.RESET
    if isinstance(exc, aiohttp.ClientError | ValueError):
        # Not HTTP, or a body that is not the JSON or UTF-8 it should be.
        return ErrorKind.PROTOCOL
    return None


async def _read_stream(
    response: aiohttp.ClientResponse, seen: _Stream, clock: Callable[[], float]
) -> None:
    """Follow an SSE body to its end, filling `seen`; what follows `[DONE]` is drained
    (so the connection can be reused) and ignored.

    The body is read in whatever pieces arrive and split into lines here: a readline per
    line costs aiohttp several times more, and the generator's CPU is what limits the rate
    it can sustain.
    """
    pending = b""
    async for piece in response.content.iter_any():
        if seen.done_at is not None:
            continue
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                _on_data(line[5:].strip(), seen, clock)
    if pending.startswith(b"data:") and seen.done_at is None:
        _on_data(pending[5:].strip(), seen, clock)


def _on_data(data: bytes, seen: _Stream, clock: Callable[[], float]) -> None:
    """One SSE `data:` payload."""
    if seen.done_at is not None:
        return
    if data == _DONE:
        seen.done_at = clock()
        return
    text = _content(data)
    if text:
        if seen.first_token_at is None:
            seen.first_token_at = clock()
        seen.words += len(text.split())
    if _USAGE_MARK in data:
        usage = json.loads(data).get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            seen.usage_tokens = usage["completion_tokens"]


def _content(data: bytes) -> str | None:
    """The chunk's `delta.content` string, decoded alone; None when it has none.

    Inside a JSON string every quote is escaped, so the first unescaped `"content":` is a
    key; a chat chunk's only such key is the delta's.
    """
    if _CONTENT_KEY not in data:
        return None
    text = data.decode()
    start = text.find(_CONTENT_KEY_TEXT) + len(_CONTENT_KEY_TEXT)
    while start < len(text) and text[start] in " \t":
        start += 1
    if start >= len(text) or text[start] != '"':
        return None  # null, or not a string
    value, _ = _DECODER.raw_decode(text, start)
    return value if isinstance(value, str) else None


def _read_completion(raw: bytes, seen: _Stream, now: float) -> None:
    """A non-streamed completion: usage, else the words of the message."""
    document = json.loads(raw)
    usage = document.get("usage") if isinstance(document, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        seen.usage_tokens = usage["completion_tokens"]
    choices = document.get("choices") if isinstance(document, dict) else None
    if isinstance(choices, list):
        for choice in choices:
            message = choice.get("message") if isinstance(choice, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                seen.words += len(content.split())
    seen.done_at = now


def _parses(raw: bytes) -> bool:
    """Whether `raw` is a JSON document (a body cut at `_MAX_ERROR_BODY` is not)."""
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def _error_code(raw: bytes) -> str | None:
    """`error.code` of an OpenAI-style error body, when there is one."""
    try:
        document = json.loads(raw)
    except ValueError:
        return None
    error = document.get("error") if isinstance(document, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return None if code is None else str(code)
