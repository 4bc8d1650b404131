"""The oracle: a router with exact, instantaneous knowledge of every pod, as the upper bound
routing benchmarks compare against (DESIGN.md, "Benchmark scenarios").

Real routers see metrics that are a scrape interval old and cannot know how many tokens each
running request still has to generate. The oracle lives in the simulator's process and
reads each engine's exact state at the moment a request arrives. For every pod that serves
the requested model it predicts the request's time to first token (`predicted_ttft`) and
sends the request to the lowest; exact ties (identical idle pods) are broken with a seeded
RNG, since always picking the first would herd bursts onto one pod.

The request is handed to the chosen pod in-process (`SimulatedPod.handle_completion`, the
same code path the pod's own HTTP handler uses): no second HTTP hop, and the pod's engine
holds the request before the next routing decision is made, so back-to-back decisions see
each other. The response carries the pod's name in `x-backend-id`.

Mutable state: `state`, `decisions` (requests routed per pod), `_rng` and the aiohttp runner.
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections.abc import Sequence
from types import TracebackType

from aiohttp import web

from llm_sim.engine import EngineState
from llm_sim.openai_api import (
    BadRequestError,
    CompletionRequest,
    model_list_document,
    parse_completion_request,
)
from llm_sim.pod import SimulatedPod, error_response
from llm_sim.profiles import HardwareProfile

__all__ = ["OracleRouter", "OracleState", "predicted_ttft"]

logger = logging.getLogger(__name__)

# Predictions closer than this are a tie (identical pods in identical states).
_TIE_S = 1e-9


def predicted_ttft(
    state: EngineState,
    profile: HardwareProfile,
    *,
    prompt_tokens: int,
    cached_tokens: int,
    adapter: str | None,
) -> float:
    """Seconds until a request arriving now would get its first token on this engine.

    Three delays add up, each from exact state:

    - waiting for a slot: with `max_num_seqs` running requests (counting those queued
      ahead), the request waits until enough running ones finish; the k-th to finish is the
      one with the k-th fewest output tokens left, each a decode step. The KV cache is a
      second gate: without free blocks for the queued prompts and this one, it waits for
      enough finishes to free them;
    - its adapter: if the batch already uses `max_loras` other adapters, until the adapter
      whose requests finish first frees its slot; plus `lora_load_s` if not resident;
    - the prefill ahead of it: the queued prompt tokens and its own uncached ones, computed
      `max_batched_tokens - n_decode` per step at `prefill_tokens_per_s`, each of those
      steps also carrying the running batch's decode.
    """
    bs = profile.block_size
    running = state.num_running
    remaining = state.running_remaining_tokens
    decode_step = (
        profile.step_base_s
        + profile.step_per_seq_s * running
        + profile.step_per_context_token_s * (state.running_context_tokens + running)
    )

    def steps_until_finishes(count: int) -> float:
        """Decode steps until `count` running requests have finished."""
        if count <= 0:
            return 0.0
        if not remaining:
            return 0.0
        if count <= len(remaining):
            return float(remaining[count - 1])
        # More than one generation ahead: whole rounds of the longest one.
        return float(remaining[-1]) * math.ceil(count / len(remaining))

    uncached = max(1, prompt_tokens - cached_tokens)
    wait_steps = steps_until_finishes(running + state.num_waiting + 1 - profile.max_num_seqs)
    needed_blocks = math.ceil((state.queued_prefill_tokens + uncached) / bs)
    free_blocks = state.kv_blocks - state.kv_blocks_used
    if needed_blocks > free_blocks and running:
        per_request = state.kv_blocks_used / running
        wait_steps = max(
            wait_steps, steps_until_finishes(math.ceil((needed_blocks - free_blocks) / per_request))
        )
    load_s = 0.0
    if adapter is not None:
        if (
            adapter not in state.running_adapters
            and len(state.running_adapters) >= profile.max_loras
            and state.adapter_remaining_tokens
        ):
            wait_steps = max(wait_steps, float(min(state.adapter_remaining_tokens.values())))
        if adapter not in state.loaded_adapters:
            load_s = profile.lora_load_s
    prefill_tokens = state.queued_prefill_tokens + uncached
    chunk = max(1, profile.max_batched_tokens - running)
    prefill_steps = math.ceil(prefill_tokens / chunk)
    return (
        (wait_steps + prefill_steps) * decode_step
        + prefill_tokens / profile.prefill_tokens_per_s
        + load_s
    )


class OracleState(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class OracleRouter:
    """An OpenAI-compatible router on 127.0.0.1 and a free port over `pods` (which the caller
    starts and stops), as an async context manager. `seed` seeds the tie-breaking RNG."""

    def __init__(
        self,
        pods: Sequence[SimulatedPod],
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if not pods:
            raise ValueError("An oracle router needs at least one pod.")
        self.pods = tuple(pods)
        self.state = OracleState.UNOPENED
        self.decisions: dict[str, int] = {pod.name: 0 for pod in self.pods}
        self._rng = random.Random(seed)
        self._host = host
        self._port = port
        self._bound_port: int | None = None
        self._runner: web.AppRunner | None = None

    def __repr__(self) -> str:
        return (
            f"<OracleRouter pods={len(self.pods)} state={self.state.value} port={self._bound_port}>"
        )

    async def __aenter__(self) -> OracleRouter:
        if self.state is not OracleState.UNOPENED:
            raise RuntimeError(
                f"Cannot start an oracle router that is {self.state.value}; it starts only once."
            )
        self.state = OracleState.OPEN
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._text)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=0.2,
        )
        try:
            await self._runner.setup()
            site = web.TCPSite(self._runner, self._host, self._port)
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            self.state = OracleState.CLOSED
            raise
        self._bound_port = int(self._runner.addresses[0][1])
        logger.info(
            "Oracle router over %d pods listening on %s:%d.",
            len(self.pods),
            self._host,
            self._bound_port,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.state is OracleState.CLOSED:
            return
        self.state = OracleState.CLOSED
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def port(self) -> int:
        if self._bound_port is None:
            raise RuntimeError("The oracle router has not been started; use `async with`.")
        return self._bound_port

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def choose(self, request: CompletionRequest) -> SimulatedPod:
        """The pod with the lowest predicted TTFT for `request`; LookupError if no pod serves
        its model. Synchronous, so the state it reads cannot change while it decides."""
        model = request.model if request.model is not None else self.pods[0].model
        candidates = [pod for pod in self.pods if pod.serves(model)]
        if not candidates:
            raise LookupError(model)
        adapter = None if model == candidates[0].model else model
        scored: list[tuple[float, SimulatedPod]] = []
        for pod in candidates:
            cached = pod.cached_prefix_tokens(request.prompt, adapter=adapter)
            score = predicted_ttft(
                pod.state_snapshot().engine,
                pod.profile,
                prompt_tokens=len(request.prompt),
                cached_tokens=cached,
                adapter=adapter,
            )
            scored.append((score, pod))
        best = min(score for score, _ in scored)
        ties = [pod for score, pod in scored if score <= best + _TIE_S]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    async def _completion(self, http_request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await http_request.read()
        try:
            request = parse_completion_request(body, chat=chat)
        except BadRequestError as exc:
            return error_response(400, str(exc), code=exc.code, param=exc.param)
        try:
            pod = self.choose(request)
        except LookupError:
            return error_response(
                404,
                f"The model `{request.model}` does not exist.",
                code="model_not_found",
                param="model",
            )
        self.decisions[pod.name] += 1
        return await pod.handle_completion(http_request, request)

    async def _chat(self, http_request: web.Request) -> web.StreamResponse:
        return await self._completion(http_request, chat=True)

    async def _text(self, http_request: web.Request) -> web.StreamResponse:
        return await self._completion(http_request, chat=False)

    async def _models(self, http_request: web.Request) -> web.Response:
        first = self.pods[0]
        adapters = sorted({a for pod in self.pods for a in pod.adapters})
        document = model_list_document(
            base_model=first.model,
            adapters=adapters,
            created=0,
            max_model_len=first.profile.max_model_len,
        )
        return web.json_response(document)

    async def _health(self, http_request: web.Request) -> web.Response:
        return web.Response()
