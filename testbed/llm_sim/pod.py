"""A simulated GPU model server: the pure engine behind a real HTTP server.

Routing quality is measured end to end through a real Envoy, so a pod must be reachable
like a vLLM pod: OpenAI-compatible completions (JSON or server-sent events), `/v1/models`,
`/health` and a `/metrics` page in the flavour of the server it imitates. Every pod also
answers the Responses API (`/v1/responses`, on the engine like a chat) and embeddings
(`/v1/embeddings`, at once, for any model it serves): responses_api. A vLLM-flavoured
pod also answers vLLM's `/tokenize`, `/v1/chat/completions/render` and
`/v1/completions/render` (token ids by the simulator's token rule, `openai_api.token_ids`),
which vllm-router's `cache_aware` asks every worker before it routes a request. An
SGLang-flavoured pod answers SGLang's `/get_load`, `/server_info` and `/model_info` (and
their `/get_` forms; `sglang_api`), which SGLang's router asks. What happens behind the
socket is `engine.Engine`, stepped by one asyncio task per pod:

- The step loop sleeps to ABSOLUTE deadlines on the event loop's clock: step k+1 starts
  exactly when step k ends. When the process falls behind (a busy event loop on a loaded
  2-core machine), it does not sleep and runs the next steps back to back until it has
  caught up, so capacity stays the profile's; the lag is accounted (`PodSnapshot`). A lag
  larger than `max_catch_up_s` is dropped (the clock is re-anchored) rather than caught up
  in a burst, and counted separately.
- A step's tokens exist at its end: they are handed to the waiting HTTP handlers only when
  the deadline passes. The first token of a request goes out at once (TTFT is exact);
  later ones every `stream_interval` tokens, to bound the HTTP writes per second.
- A client that disconnects is aborted in the engine (its KV blocks are freed), through
  aiohttp's handler cancellation.
- Faults, for the fault benchmark (scenario g): `kill()` is what SIGKILL does to a model
  server (the listening socket closes, so the port refuses, and every open connection is
  cut at once, mid-response or not); `revive()` serves again on the same port with a fresh
  engine (empty caches, counters from zero, as a restarted vLLM); `reset_prefilling()` cuts
  the connections of the requests that have no first token yet. Like vLLM (Starlette sends
  a streaming response's headers before its first chunk), a streamed response's headers are
  already out when its prefill starts.
- Gray failures, pods that look healthy but do not serve: `/health`, `/v1/models` and
  `/metrics` answer as usual while completions do not. `wedge(after_chunks=N)` is a hung
  generation: every request, running or new, stops after the tokens of its first N SSE
  chunks (a non-streamed one never answers), and stays in the engine, running, with its KV
  blocks (`Engine.stall`); `unwedge()` lets the stuck requests go on. `reset_requests(True)`
  resets (RST) the connection of every new completion before any response byte.
  `freeze()` is SIGSTOP: the port still accepts (the kernel does that), but nothing is
  answered or written and the engine does not step until `thaw()`; the frozen time is
  lost, not caught up in a burst, and a step in progress at the freeze delivers its tokens
  at the thaw (the GPU is not stopped, only the process). `revive()` clears them all.
- A late metrics page: `revive(metrics_after_s=N)` serves completions and `/health` at once
  but answers `/metrics` only N seconds after the revival (a request waits until then), as
  a real vLLM restarted under load did for ~40 s (issue 36); `hold_metrics(N)` does the
  same without a restart.

`handle_completion` is the one path from a parsed request to a response; the pod's own
handlers use it, and so does the oracle router, which calls it in-process for the pod it
picked (no second HTTP hop). `state_snapshot()` is the exact state.

Mutable state: `state`, `_streams` (request id -> delivery), `_failure` (why the step loop
died, if it did: the pod then answers 503), the lag counters, `_http`, `requests_seen`,
the fault switches `_resetting`, `_thawed` (set when not frozen) and `_metrics_at` (the
loop time before which `/metrics` does not answer), the engine (changed only by `add`/`abort`
in handlers, `stall` in `wedge`/`unwedge` and `step` in the loop, all on the event loop's
thread; replaced by `revive`) and the aiohttp runner.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import json
import logging
import math
import socket
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from llm_sim.engine import Engine, EngineRequest, EngineState, StepOutcome
from llm_sim.kv_cache import Token
from llm_sim.metrics_text import (
    FILTERABLE,
    Flavour,
    HttpStats,
    content_type,
    render_metrics,
    restrict_page,
)
from llm_sim.openai_api import (
    BadRequestError,
    CompletionRequest,
    chunk_document,
    completion_document,
    error_document,
    model_list_document,
    parse_completion_request,
    parse_tokenize_request,
    render_document,
    tokenize_document,
    usage_chunk_document,
)
from llm_sim.profiles import H100, HardwareProfile
from llm_sim.responses_api import (
    ResponseEvents,
    embeddings_document,
    parse_embedding_request,
    parse_responses_request,
    response_document,
)
from llm_sim.sglang_api import load_document, model_info_document, server_info_document

__all__ = [
    "BACKEND_ID_HEADER",
    "DEFAULT_MODEL",
    "PodSnapshot",
    "PodState",
    "SimulatedPod",
    "error_response",
]

logger = logging.getLogger(__name__)

BACKEND_ID_HEADER = "x-backend-id"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# Prompts can be large; aiohttp refuses bodies over 1 MiB by default.
_MAX_BODY_BYTES = 64 << 20
_SHUTDOWN_S = 0.2


class _Http2PrefaceFilter(logging.Filter):
    """Drops aiohttp's error (with traceback) for a client that opens with HTTP/2's
    connection preface: SGLang's router sends one to every worker, probing for gRPC beside
    its HTTP health check, and the pod answers 400 as any HTTP/1 server does."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, BadHttpMessage) and "PRI/Upgrade" in str(error))


# The pods' HTTP server log (aiohttp's, under the pod's name).
_http_logger = logging.getLogger(f"{__name__}.http")
_http_logger.addFilter(_Http2PrefaceFilter())


class PodState(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    # Killed (`kill()`): the port refuses until `revive()`.
    KILLED = "killed"
    CLOSED = "closed"


@dataclass(frozen=True, kw_only=True)
class PodSnapshot:
    """A pod's exact state at `time` (event-loop clock).

    `lag_s_total` and `lag_s_max` measure how late step ends were delivered behind their
    deadlines (caught up afterwards); `lag_s_dropped` is time lost to re-anchoring after a
    stall longer than `max_catch_up_s` (capacity really lost). A `freeze()` is no lag: its
    time counts in none of these. `in_flight` counts HTTP completions being served.
    """

    name: str
    profile: HardwareProfile
    flavour: Flavour
    model: str
    adapters: tuple[str, ...]
    time: float
    engine: EngineState
    in_flight: int
    steps: int
    lag_s_total: float
    lag_s_max: float
    lag_s_dropped: float


class _Delivery:
    """Tokens on their way from the step loop to one HTTP handler."""

    __slots__ = ("broken", "finished", "interval", "pending", "produced", "transport", "wake")

    def __init__(self, interval: int, transport: asyncio.Transport | None) -> None:
        self.interval = interval
        # The HTTP connection the tokens go out on (None when served in-process).
        self.transport = transport
        self.pending: list[str] = []
        self.produced = 0
        self.finished = False
        self.broken = False  # the step loop died: no more tokens will come
        self.wake = asyncio.Event()

    def push(self, token: str, *, finished: bool) -> None:
        self.pending.append(token)
        self.produced += 1
        if finished:
            self.finished = True
        if finished or self.produced == 1 or len(self.pending) >= self.interval:
            self.wake.set()

    def take(self) -> list[str]:
        tokens, self.pending = self.pending, []
        self.wake.clear()
        return tokens

    def break_off(self) -> None:
        self.broken = True
        self.wake.set()


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    backend_id: str | None = None,
    param: str | None = None,
) -> web.Response:
    """An OpenAI-style JSON error response."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {BACKEND_ID_HEADER: backend_id} if backend_id else None
    return web.json_response(
        error_document(message, type=kind, code=code, param=param), status=status, headers=headers
    )


class SimulatedPod:
    """A simulated model server on 127.0.0.1 and a free port, as an async context manager.

    `model` is the base model's name and `adapters` the LoRA adapters the pod serves (a
    request names either); `flavour` picks the `/metrics` format; `stream_interval` is the
    number of tokens per SSE chunk after the first; `default_max_tokens` applies when a
    request sets no limit; `seed` fixes the output words.
    """

    def __init__(
        self,
        name: str,
        *,
        profile: HardwareProfile = H100,
        model: str = DEFAULT_MODEL,
        adapters: Sequence[str] = (),
        flavour: Flavour = Flavour.VLLM,
        stream_interval: int = 1,
        default_max_tokens: int = 256,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        max_catch_up_s: float = 0.5,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, not {stream_interval}.")
        if adapters and profile.max_loras < 1:
            raise ValueError(f"Pod {name}: profile {profile.name} has no LoRA slots.")
        if model in adapters or len(set(adapters)) != len(adapters):
            raise ValueError(f"Pod {name}: model and adapter names must be distinct.")
        self.name = name
        self.profile = profile
        self.model = model
        self.adapters = tuple(adapters)
        self.flavour = flavour
        self.stream_interval = stream_interval
        self.default_max_tokens = default_max_tokens
        self.max_catch_up_s = max_catch_up_s
        self.state = PodState.UNOPENED
        self._seed = seed
        self._engine = Engine(profile, seed=seed)
        self._host = host
        self._port = port
        self._bound_port: int | None = None
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._work = asyncio.Event()
        self._streams: dict[str, _Delivery] = {}
        self._failure: BaseException | None = None
        self._resetting = False
        self.kv_claim = 1.0
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._metrics_at = 0.0
        self._ids = itertools.count(1)
        self._http = HttpStats()
        # Every request the server got, by (method, path), whatever its answer (a 404 too).
        self.requests_seen: collections.Counter[tuple[str, str]] = collections.Counter()
        self._steps = 0
        self._lag_total = 0.0
        self._lag_max = 0.0
        self._lag_dropped = 0.0
        self._created = int(time.time())

    def __repr__(self) -> str:
        return (
            f"<SimulatedPod {self.name} {self.profile.name} state={self.state.value} "
            f"port={self._bound_port} running={self._engine.num_running} "
            f"waiting={self._engine.num_waiting}>"
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> SimulatedPod:
        if self.state is not PodState.UNOPENED:
            raise RuntimeError(
                f"Cannot start simulated pod {self.name}: it is {self.state.value}, and a pod "
                "can be started only once."
            )
        self.state = PodState.OPEN
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _start(self) -> None:
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._observe])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._text)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        if self.flavour is Flavour.VLLM:
            app.router.add_post("/tokenize", self._tokenize)
            app.router.add_post("/v1/chat/completions/render", self._render_chat)
            app.router.add_post("/v1/completions/render", self._render_text)
        if self.flavour is Flavour.TRTLLM_SERVE:
            # trtllm-serve's Prometheus page (its own /metrics is JSON iteration stats).
            app.router.add_get("/prometheus/metrics", self._metrics)
        if self.flavour is Flavour.SGLANG:
            app.router.add_get("/get_load", self._sglang_load)
            for path in ("/server_info", "/get_server_info"):
                app.router.add_get(path, self._sglang_server_info)
            for path in ("/model_info", "/get_model_info"):
                app.router.add_get(path, self._sglang_model_info)
        # A stopped pod cuts its in-flight responses within `_SHUTDOWN_S`, like a killed one.
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_S,
            logger=_http_logger,
        )
        await self._runner.setup()
        await self._serve(self._port)
        logger.info(
            "Simulated pod %s (%s, %s) listening on %s:%d.",
            self.name,
            self.profile.name,
            self.flavour.value,
            self._host,
            self._bound_port,
        )

    async def _serve(self, port: int) -> None:
        """Listen on `port` (0: any free port) and start the step loop."""
        assert self._runner is not None
        site = web.TCPSite(self._runner, self._host, port)
        await site.start()
        self._bound_port = int(self._runner.addresses[0][1])
        self._loop_task = asyncio.create_task(self._run(), name=f"sim-pod-{self.name}")
        self._loop_task.add_done_callback(self._loop_done)

    async def kill(self) -> int:
        """Die as a SIGKILLed server does: stop listening (the port then refuses), cut every
        open connection at once without flushing, and stop the engine. Returns the number
        of connections cut. `revive()` brings the pod back; `async with`'s exit still
        cleans up."""
        if self.state is not PodState.OPEN:
            raise RuntimeError(f"Cannot kill simulated pod {self.name}: it is {self.state.value}.")
        assert self._runner is not None and self._runner.server is not None
        self.state = PodState.KILLED
        for site in list(self._runner.sites):
            await site.stop()
        cut = 0
        for handler in self._runner.server.connections:
            if handler.transport is not None:
                handler.transport.abort()
                cut += 1
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        # No more tokens will come: handlers whose cancellation has not arrived yet end now.
        for delivery in self._streams.values():
            delivery.break_off()
        logger.info("Simulated pod %s killed: %d connections cut.", self.name, cut)
        return cut

    async def revive(self, *, metrics_after_s: float = 0.0) -> None:
        """Serve again on the same port after `kill()`, with a fresh engine (empty KV and
        prefix caches, no adapters loaded), `/metrics` counters from zero and no gray
        failure (a restarted process is neither wedged nor frozen). `/metrics` answers only
        `metrics_after_s` after this (`hold_metrics`)."""
        if self.state is not PodState.KILLED:
            raise RuntimeError(
                f"Cannot revive simulated pod {self.name}: it is {self.state.value}, not killed."
            )
        self._engine = Engine(self.profile, seed=self._seed)
        self._work = asyncio.Event()
        self._failure = None
        self._resetting = False
        self._thawed.set()
        self._http = HttpStats()
        self._created = int(time.time())
        self.hold_metrics(metrics_after_s)
        await self._serve(self.port)
        self.state = PodState.OPEN
        logger.info("Simulated pod %s revived on port %d.", self.name, self.port)

    def hold_metrics(self, seconds: float) -> None:
        """Answer `/metrics` only `seconds` from now: a scrape sent meanwhile waits until
        then (and times out first, if its timeout is shorter); everything else answers."""
        if seconds < 0:
            raise ValueError(f"seconds must not be negative, not {seconds}.")
        self._metrics_at = asyncio.get_running_loop().time() + seconds
        if seconds:
            logger.info("Simulated pod %s holds /metrics for %g s.", self.name, seconds)

    def reset_prefilling(self) -> int:
        """Cut (TCP abort) the connection of every request that has not produced its first
        token yet: waiting or prefilling. Returns how many were cut."""
        cut = 0
        for delivery in self._streams.values():
            if delivery.produced == 0 and delivery.transport is not None:
                delivery.transport.abort()
                cut += 1
        logger.info(
            "Simulated pod %s reset %d connections before their first token.", self.name, cut
        )
        return cut

    def wedge(self, after_chunks: int) -> None:
        """Hang generation: from now on no request goes past the tokens of its first
        `after_chunks` SSE chunks (its first token, then `stream_interval` tokens a chunk),
        nor finishes, so a non-streamed one never answers. A request already past that
        stops at once. The stuck requests stay in the engine (running, KV held) until
        `unwedge()`."""
        if after_chunks < 0:
            raise ValueError(f"after_chunks must not be negative, not {after_chunks}.")
        tokens = 0 if after_chunks == 0 else 1 + (after_chunks - 1) * self.stream_interval
        self._engine.stall(tokens)
        logger.info("Simulated pod %s wedged after %d chunks.", self.name, after_chunks)

    def unwedge(self) -> None:
        """Serve normally again; the stuck requests go on from where they stopped."""
        self._engine.stall(None)
        self._work.set()
        logger.info("Simulated pod %s unwedged.", self.name)

    def reset_requests(self, enabled: bool) -> None:
        """While `enabled`, reset (RST) the connection of every new completion request
        before any response byte; requests already in flight are not touched."""
        self._resetting = enabled
        logger.info(
            "Simulated pod %s %s completion requests.",
            self.name,
            "resets" if enabled else "no longer resets",
        )

    def claim_capacity(self, factor: float) -> None:
        """Make the vLLM metrics page claim `factor` times the KV cache the pod has (and a
        use of it `factor` times smaller): a misconfigured or lying pod. 1 tells the truth."""
        self.kv_claim = factor
        logger.info("Simulated pod %s claims %gx its KV cache.", self.name, factor)

    def freeze(self) -> None:
        """Stop as SIGSTOP does: until `thaw()`, no request of any kind is answered, no
        chunk is written and the engine does not step."""
        self._thawed.clear()
        logger.info("Simulated pod %s frozen.", self.name)

    def thaw(self) -> None:
        """Go on from where `freeze()` stopped, the frozen time lost."""
        self._thawed.set()
        logger.info("Simulated pod %s thawed.", self.name)

    async def _stop(self) -> None:
        if self.state is PodState.CLOSED:
            return
        self.state = PodState.CLOSED
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._runner is not None:
            await asyncio.shield(self._runner.cleanup())

    def _loop_done(self, task: asyncio.Task[None]) -> None:
        """A step loop that dies fails its pod loudly: in-flight responses are cut off and
        new requests get 503, rather than waiting forever for tokens."""
        if task.cancelled() or self.state is PodState.CLOSED:
            return
        self._failure = task.exception()
        logger.error(
            "The step loop of simulated pod %s died; the pod now fails every request.",
            self.name,
            exc_info=self._failure,
        )
        for delivery in self._streams.values():
            delivery.break_off()

    def _require_open(self) -> None:
        if self.state is not PodState.OPEN:
            raise RuntimeError(
                f"Simulated pod {self.name} is {self.state.value}; use it inside `async with`."
            )

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The bound port."""
        if self._bound_port is None:
            raise RuntimeError(f"Simulated pod {self.name} has not been started; use `async with`.")
        return self._bound_port

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def models(self) -> tuple[str, ...]:
        """Every model name a request may use here: the base model, then the adapters."""
        return (self.model, *self.adapters)

    def serves(self, model: str | None) -> bool:
        return model is None or model == self.model or model in self.adapters

    # -- the step loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self._engine
        next_start: float | None = None
        engine_time = -math.inf  # the engine's clock never goes backwards
        idle_with_work = 0
        while True:
            if not engine.has_work():
                self._work.clear()
                await self._work.wait()
                next_start = None
            if not self._thawed.is_set():
                await self._thawed.wait()
                next_start = None  # a stopped process loses the frozen time
            now = loop.time()
            if next_start is None:
                start = now
            elif now - next_start > self.max_catch_up_s:
                self._lag_dropped += now - next_start
                start = now
            else:
                start = next_start
            start = max(start, engine_time)
            outcome = engine.step(start)
            engine_time = outcome.end
            if outcome.idle:
                # Only requests that arrived after `start` (we were catching up): start the
                # next step from the present. Idle from the present too: every request left
                # is stalled (`wedge`) or finds no seat or KV blocks beside the stalled
                # ones; wait for a request to come or go, or for the stall to be lifted.
                next_start = None
                idle_with_work += 1
                if idle_with_work < 2:
                    await asyncio.sleep(0)
                else:
                    self._work.clear()
                    await self._work.wait()
                continue
            idle_with_work = 0
            self._steps += 1
            deadline = outcome.end
            if deadline > loop.time():
                await _sleep_until(loop, deadline)
            else:
                await asyncio.sleep(0)  # behind: no sleep, but let the handlers write
            if not self._thawed.is_set():
                # Frozen mid-step: the step's tokens are out at the thaw, the next step
                # starts then.
                await self._thawed.wait()
                deadline = loop.time()
            lag = loop.time() - deadline
            if lag > 0:
                self._lag_total += lag
                self._lag_max = max(self._lag_max, lag)
            self._deliver(outcome)
            next_start = deadline

    def _deliver(self, outcome: StepOutcome) -> None:
        finished = set(outcome.finished)
        streams = self._streams
        for request_id, token in outcome.tokens.items():
            delivery = streams.get(request_id)
            if delivery is not None:
                delivery.push(token, finished=request_id in finished)

    # -- completions ------------------------------------------------------------------------

    def _resolve(self, model: str | None) -> tuple[str, str | None]:
        """(model name to answer with, adapter or None); KeyError if not served."""
        if model is None or model == self.model:
            return self.model, None
        if model in self.adapters:
            return model, model
        raise KeyError(model)

    async def handle_completion(
        self, http_request: web.Request, request: CompletionRequest
    ) -> web.StreamResponse:
        """Serve a parsed completion request on `http_request`'s connection.

        Returns the response (already sent when streaming). Unknown model: 404; a request
        the engine refuses (too long for the KV cache): 400. The response names this pod
        in `x-backend-id`.
        """
        if self.state is PodState.KILLED and http_request.transport is not None:
            # Accepted just before the kill: a killed server never answers it.
            http_request.transport.abort()
            raise ConnectionResetError(f"Simulated pod {self.name} is killed.")
        self._require_open()
        if self._resetting and http_request.transport is not None:
            # SO_LINGER 0: the abort sends RST rather than FIN, as a crashing server's does.
            sock = http_request.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            http_request.transport.abort()
            raise ConnectionResetError(f"Simulated pod {self.name} resets every completion.")
        if self._failure is not None:
            return error_response(
                503,
                f"Simulated pod {self.name} is broken: its engine loop died.",
                code="engine_dead",
                backend_id=self.name,
            )
        try:
            model, adapter = self._resolve(request.model)
        except KeyError:
            return error_response(
                404,
                f"The model `{request.model}` does not exist.",
                code="model_not_found",
                param="model",
                backend_id=self.name,
            )
        loop = asyncio.get_running_loop()
        # A handler outlives its engine when the pod is killed and revived.
        engine = self._engine
        kind = "resp" if request.responses else "chatcmpl" if request.chat else "cmpl"
        request_id = f"{kind}-{self.name}-{next(self._ids)}"
        max_tokens = request.max_tokens or self.default_max_tokens
        try:
            engine.add(
                EngineRequest(
                    request_id=request_id,
                    prompt=request.prompt,
                    max_tokens=max_tokens,
                    adapter=adapter,
                    arrival=loop.time(),
                )
            )
        except ValueError as exc:
            return error_response(400, str(exc), code="invalid_request", backend_id=self.name)
        delivery = _Delivery(
            self.stream_interval if request.stream else max_tokens + 1, http_request.transport
        )
        self._streams[request_id] = delivery
        self._work.set()
        try:
            if request.stream:
                return await self._stream(http_request, request, request_id, model, delivery)
            tokens: list[str] = []
            while not delivery.finished:
                await delivery.wake.wait()
                tokens.extend(delivery.take())
                if delivery.broken:
                    return error_response(
                        503, "The engine loop died.", code="engine_dead", backend_id=self.name
                    )
            tokens.extend(delivery.take())
            if request.responses:
                document = response_document(
                    request_id=request_id,
                    created=int(time.time()),
                    model=model,
                    text=" ".join(tokens),
                    finished=False,
                    prompt_tokens=len(request.prompt),
                    completion_tokens=len(tokens),
                )
            else:
                document = completion_document(
                    request_id=request_id,
                    created=int(time.time()),
                    model=model,
                    chat=request.chat,
                    text=" ".join(tokens),
                    finish_reason="length",
                    prompt_tokens=len(request.prompt),
                    completion_tokens=len(tokens),
                )
            return web.json_response(
                document, headers={BACKEND_ID_HEADER: self.name}, dumps=_compact_dumps
            )
        finally:
            del self._streams[request_id]
            if not delivery.finished and engine.abort(request_id):
                self._work.set()  # its seat and KV blocks may let a waiting request in
                logger.debug("Pod %s aborted %s: the client went away.", self.name, request_id)

    async def _stream(
        self,
        http_request: web.Request,
        request: CompletionRequest,
        request_id: str,
        model: str,
        delivery: _Delivery,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                BACKEND_ID_HEADER: self.name,
            }
        )
        await self._thawed.wait()  # frozen since the request came in: not even headers
        await response.prepare(http_request)
        created = int(time.time())
        events = None
        if request.responses:
            events = ResponseEvents(request_id=request_id, created=created, model=model)
        first = True
        try:
            for frame in events.opening() if events is not None else ():
                await response.write(frame)
            while True:
                await delivery.wake.wait()
                await self._thawed.wait()
                tokens = delivery.take()
                done = delivery.finished
                if delivery.broken and not done:
                    # Cut the stream off mid-response, as a crashed server would.
                    if http_request.transport is not None:
                        http_request.transport.abort()
                    return response
                text = " ".join(tokens) if first else " " + " ".join(tokens)
                if events is not None:
                    await response.write(events.delta(text))
                else:
                    payload = chunk_document(
                        request_id=request_id,
                        created=created,
                        model=model,
                        chat=request.chat,
                        text=text,
                        first=first,
                        finish_reason="length" if done else None,
                    )
                    await response.write(b"data: " + payload.encode() + b"\n\n")
                first = False
                if done:
                    break
            if events is not None:
                # The Responses API's stream ends with its final response, no `[DONE]`.
                closing = events.closing(
                    prompt_tokens=len(request.prompt), completion_tokens=delivery.produced
                )
                for frame in closing:
                    await response.write(frame)
                await response.write_eof()
                return response
            if request.include_usage:
                usage = usage_chunk_document(
                    request_id=request_id,
                    created=created,
                    model=model,
                    chat=request.chat,
                    prompt_tokens=len(request.prompt),
                    completion_tokens=delivery.produced,
                )
                await response.write(b"data: " + usage.encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            logger.debug("Pod %s: the client of %s disconnected.", self.name, request_id)
        return response

    # -- HTTP handlers ------------------------------------------------------------------------

    @web.middleware
    async def _observe(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        self.requests_seen[request.method, request.path] += 1
        await self._thawed.wait()
        started = time.perf_counter()
        try:
            response = await handler(request)
        except ConnectionResetError:
            # The handler cut its own connection (a fault): nothing goes out, nothing is
            # counted, and aiohttp has no error to log.
            return web.Response()
        await self._thawed.wait()  # frozen while it was being served: nothing goes out
        resource = request.match_info.route.resource
        self._http.observe(
            handler=resource.canonical if resource is not None else request.path,
            method=request.method,
            status=response.status,
            duration_s=time.perf_counter() - started,
            request_bytes=request.content_length or 0,
            response_bytes=response.body_length or response.content_length or 0,
        )
        return response

    async def _completion(self, http_request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await http_request.read()
        try:
            request = parse_completion_request(body, chat=chat)
        except BadRequestError as exc:
            return error_response(
                400, str(exc), code=exc.code, param=exc.param, backend_id=self.name
            )
        return await self.handle_completion(http_request, request)

    async def _chat(self, http_request: web.Request) -> web.StreamResponse:
        return await self._completion(http_request, chat=True)

    async def _text(self, http_request: web.Request) -> web.StreamResponse:
        return await self._completion(http_request, chat=False)

    async def _responses(self, http_request: web.Request) -> web.StreamResponse:
        try:
            request = parse_responses_request(await http_request.read())
        except BadRequestError as exc:
            return error_response(
                400, str(exc), code=exc.code, param=exc.param, backend_id=self.name
            )
        return await self.handle_completion(http_request, request)

    async def _embeddings(self, http_request: web.Request) -> web.Response:
        try:
            request = parse_embedding_request(await http_request.read())
            model, _ = self._resolve(request.model)
        except BadRequestError as exc:
            return error_response(
                400, str(exc), code=exc.code, param=exc.param, backend_id=self.name
            )
        except KeyError:
            return error_response(
                404,
                f"The model `{request.model}` does not exist.",
                code="model_not_found",
                param="model",
                backend_id=self.name,
            )
        document = embeddings_document(
            request,
            request_id=f"embd-{self.name}-{next(self._ids)}",
            created=int(time.time()),
            model=model,
        )
        return web.json_response(
            document, headers={BACKEND_ID_HEADER: self.name}, dumps=_compact_dumps
        )

    async def _prepare(
        self, http_request: web.Request, parse: Callable[[bytes], CompletionRequest]
    ) -> tuple[CompletionRequest, str] | web.Response:
        """(request, model name) of a tokenize or render body, or vLLM's refusal of it: 400
        for a bad body or a prompt over `max_model_len` (which also bounds the answer), 404
        for a model the pod does not serve."""
        try:
            request = parse(await http_request.read())
        except BadRequestError as exc:
            return error_response(
                400, str(exc), code=exc.code, param=exc.param, backend_id=self.name
            )
        try:
            model, _ = self._resolve(request.model)
        except KeyError:
            return error_response(
                404,
                f"The model `{request.model}` does not exist.",
                code="model_not_found",
                param="model",
                backend_id=self.name,
            )
        limit = self.profile.max_model_len
        if len(request.prompt) > limit:
            return error_response(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {len(request.prompt)} input tokens.",
                code="invalid_request",
                backend_id=self.name,
            )
        return request, model

    async def _tokenize(self, http_request: web.Request) -> web.Response:
        prepared = await self._prepare(http_request, parse_tokenize_request)
        if isinstance(prepared, web.Response):
            return prepared
        document = tokenize_document(prepared[0].prompt, max_model_len=self.profile.max_model_len)
        return web.json_response(
            document, headers={BACKEND_ID_HEADER: self.name}, dumps=_compact_dumps
        )

    async def _render(self, http_request: web.Request, *, chat: bool) -> web.Response:
        prepared = await self._prepare(
            http_request, lambda body: parse_completion_request(body, chat=chat)
        )
        if isinstance(prepared, web.Response):
            return prepared
        request, model = prepared
        document = render_document(
            request,
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            model=model,
            max_tokens=request.max_tokens or self.default_max_tokens,
        )
        # vLLM renders a completion's prompt as a batch: a list of one here.
        return web.json_response(
            document if chat else [document],
            headers={BACKEND_ID_HEADER: self.name},
            dumps=_compact_dumps,
        )

    async def _render_chat(self, http_request: web.Request) -> web.Response:
        return await self._render(http_request, chat=True)

    async def _render_text(self, http_request: web.Request) -> web.Response:
        return await self._render(http_request, chat=False)

    async def _models(self, http_request: web.Request) -> web.Response:
        document = model_list_document(
            base_model=self.model,
            adapters=self.adapters,
            created=self._created,
            max_model_len=self.profile.max_model_len,
        )
        return web.json_response(document, headers={BACKEND_ID_HEADER: self.name})

    async def _sglang_load(self, http_request: web.Request) -> web.Response:
        document = load_document(self._engine.state(), profile=self.profile)
        return web.json_response(document, headers={BACKEND_ID_HEADER: self.name})

    async def _sglang_server_info(self, http_request: web.Request) -> web.Response:
        document = server_info_document(model=self.model, profile=self.profile)
        return web.json_response(document, headers={BACKEND_ID_HEADER: self.name})

    async def _sglang_model_info(self, http_request: web.Request) -> web.Response:
        document = model_info_document(model=self.model)
        return web.json_response(document, headers={BACKEND_ID_HEADER: self.name})

    async def _health(self, http_request: web.Request) -> web.Response:
        return web.Response(headers={BACKEND_ID_HEADER: self.name})

    async def _metrics(self, http_request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        if self._metrics_at > loop.time():
            await _sleep_until(loop, self._metrics_at)
        page = self.render_metrics()
        names = http_request.query.getall("name[]", [])
        if names and self.flavour in FILTERABLE:
            page = restrict_page(page, names)
        return web.Response(
            body=page.encode(),
            headers={"Content-Type": content_type(self.flavour), BACKEND_ID_HEADER: self.name},
        )

    # -- state ------------------------------------------------------------------------------

    def render_metrics(self) -> str:
        """The `/metrics` page as it stands now."""
        loop_now = asyncio.get_running_loop().time()
        return render_metrics(
            self._engine,
            flavour=self.flavour,
            model_name=self.model,
            lora_enabled=bool(self.adapters),
            unix_offset=time.time() - loop_now,
            http=self._http,
            kv_claim=self.kv_claim,
        )

    def cached_prefix_tokens(self, prompt: Sequence[Token], *, adapter: str | None) -> int:
        """Prompt tokens this pod's prefix cache would serve right now (see `Engine`)."""
        return self._engine.cached_prefix_tokens(prompt, adapter=adapter)

    def state_snapshot(self) -> PodSnapshot:
        """The pod's exact state now: the engine's, plus the step loop's lag accounting."""
        return PodSnapshot(
            name=self.name,
            profile=self.profile,
            flavour=self.flavour,
            model=self.model,
            adapters=self.adapters,
            time=asyncio.get_running_loop().time(),
            engine=self._engine.state(),
            in_flight=len(self._streams),
            steps=self._steps,
            lag_s_total=self._lag_total,
            lag_s_max=self._lag_max,
            lag_s_dropped=self._lag_dropped,
        )


async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    """Sleep until the loop's clock reads `deadline` (absolute, unlike asyncio.sleep)."""
    waiter: asyncio.Future[None] = loop.create_future()
    handle = loop.call_at(deadline, _wake, waiter)
    try:
        await waiter
    finally:
        handle.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _compact_dumps(document: object) -> str:
    return json.dumps(document, separators=(",", ":"))
