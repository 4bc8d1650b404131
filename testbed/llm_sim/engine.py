"""A vLLM-v1-like inference engine without a GPU: the scheduler, the KV cache and the clock
arithmetic, so that routing decisions meet the same queueing a real model server has.

Why simulate at this level: a router's quality shows in TTFT tails, and those come from the
engine's mechanics, not from averages. A request waits because the batch is full
(`max_num_seqs`), because the token budget is spent on someone's long prompt (chunked
prefill), because the KV cache is full (and then someone is preempted and recomputed),
because its LoRA adapter has no free slot, or because a prefix-cache hit let another request
skip most of its prefill. Each of these is modelled the way vLLM v1's scheduler does it
(`vllm/v1/core/sched/scheduler.py`), step by step:

1. Running requests first, in admission order: each asks for its remaining prompt (a chunk,
   within the step's token budget) or one decode token. If its KV blocks cannot be
   allocated, the newest running request is preempted (blocks freed, back to the front of
   the waiting queue, its prompt and output recomputed later) until they can.
2. Then, if nobody was preempted this step, waiting requests first-come-first-served while
   `running < max_num_seqs`, the budget lasts and KV blocks allow. A request whose LoRA
   adapter would exceed `max_loras` adapters in the batch is skipped and later requests are
   considered (it keeps its place at the head of the queue). A request's cached prefix
   (full 16-token blocks; see `kv_cache.py`) is not computed again.
3. The step takes `d0 + d_b·n_decode + c·Σcontext + n_prefill/P` seconds (the profile's
   numbers; context is what the decoding sequences attend to), plus `lora_load_s` for each
   adapter loaded into a slot. At its end every request whose prompt is complete emits one
   token; a request that reaches `max_tokens` finishes and frees its blocks.

One whitespace word is one token and tokens are the words themselves, so prompts hash into
blocks exactly and no tokenizer is needed; output words are drawn from a small vocabulary
with a seeded RNG.

A wedged server (`stall`, for the pod's gray-failure faults) keeps its stuck requests: a
request that has produced its quota of output tokens is no longer scheduled but keeps its
place, its KV blocks and its seat in the batch, so `/metrics` shows it running (or waiting,
if it stalls before its first token or is preempted), as a server whose generation hangs
would. Neither does it finish: the quota stops it short of its last token.

Pure: no asyncio, no I/O, no clock. The caller passes the time into `step` and sleeps for
`StepOutcome.duration` itself (`pod.py`). State changes only inside `add`, `abort`, `stall`
and `step`; `state()` is a frozen copy, exact, for the oracle router and for `/metrics`.

Mutable state: `_waiting`, `_running`, `_requests`, `_pool`, `_loaded`, `_stall_after`, the
counters, the histograms in `histograms`, `_lora_info` and `_rng`.
"""

from __future__ import annotations

import enum
import math
import random
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llm_sim.kv_cache import BlockPool, Token, block_hashes
from llm_sim.profiles import HardwareProfile
from llm_sim.stats import (
    ITERATION_TOKEN_BUCKETS,
    N_PARAM_BUCKETS,
    PREFILL_TOKEN_TIME_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    build_1_2_5_buckets,
)

__all__ = [
    "Engine",
    "EngineHistograms",
    "EngineRequest",
    "EngineState",
    "FinishReason",
    "StepOutcome",
]

# Output words. Any fixed list works; these read like text in a demo.
_VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "if so no will more can said who them some could time these two may first then do "
    "any like my now over such our man me even most made after also did many before must"
).split()


class FinishReason(enum.Enum):
    """Why a request left the engine (vLLM's `finished_reason` label values)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """One generation request as the engine sees it.

    `prompt` is the prompt's tokens (words, or token ids); `adapter` names a LoRA adapter
    or is None for the base model; `arrival` is when the request reached the server, on the
    same clock as `Engine.step`'s `now` (a request is not scheduled in a step that starts
    before it).
    """

    request_id: str
    prompt: tuple[Token, ...]
    max_tokens: int
    adapter: str | None = None
    arrival: float


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What one engine step did. Its tokens exist at `end`, not before.

    `tokens` maps each request that emitted a token this step to that token (at most one
    per request per step); `finished` lists requests that reached `max_tokens` (their last
    token is in `tokens`); `preempted` lists requests sent back to the waiting queue.
    """

    start: float
    duration: float
    tokens: Mapping[str, str]
    finished: tuple[str, ...]
    preempted: tuple[str, ...]
    scheduled_tokens: int
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    adapters_loaded: tuple[str, ...]

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def idle(self) -> bool:
        """True when nothing could be scheduled (the step took no time)."""
        return self.scheduled_tokens == 0


@dataclass(frozen=True, kw_only=True)
class EngineState:
    """An exact copy of the engine's observable state at `time` (the last step's end).

    `num_prefilling` counts running requests whose prompt is not fully computed yet.
    Token counts: `queued_prefill_tokens` is the prompt work not yet done, for waiting
    requests net of the prefix cache as it stands now, for running ones their unfinished
    prompt chunks; `waiting_prompt_tokens` is the waiting requests' whole prompts (what
    SGLang's `/get_load` counts for its queue); `running_context_tokens` is the context the
    running batch attends to.
    `running_remaining_tokens` lists, ascending, how many output tokens each running request
    still has to produce, and `adapter_remaining_tokens` the most any running request of
    each adapter has left. `lora_info` is the history behind `vllm:lora_requests_info`:
    (running adapters, waiting adapters, engine time of the last step with that state).
    """

    time: float
    steps: int
    num_running: int
    num_waiting: int
    num_prefilling: int
    kv_usage: float
    kv_blocks: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    finished: Mapping[FinishReason, int]
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]
    loaded_adapters: tuple[str, ...]
    # LoRA adapter loads into a slot, requests with an adapter scheduled for the first
    # time, and how many of those found their adapter already loaded.
    adapter_loads: int
    adapter_requests: int
    adapter_hits: int
    queued_prefill_tokens: int
    waiting_prompt_tokens: int
    running_context_tokens: int
    running_remaining_tokens: tuple[int, ...]
    adapter_remaining_tokens: Mapping[str, int]
    lora_info: tuple[tuple[str, str, float], ...]


class EngineHistograms:
    """The per-request and per-step histograms vLLM v1 exports, with its buckets."""

    def __init__(self, *, max_model_len: int) -> None:
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.inter_token_latency = Histogram(TPOT_BUCKETS)
        self.request_time_per_output_token = Histogram(TPOT_BUCKETS)
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.time_per_prefill_token = Histogram(PREFILL_TOKEN_TIME_BUCKETS)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.request_max_num_generation_tokens = Histogram(token_buckets)
        self.request_params_max_tokens = Histogram(token_buckets)
        self.request_params_n = Histogram(N_PARAM_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)


class _Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"


class _Seq:
    """A request inside the engine: its tokens so far and its KV blocks."""

    __slots__ = (
        "blocks",
        "first_token_at",
        "hashes",
        "last_token_at",
        "num_cached_blocks",
        "num_computed",
        "prompt_len",
        "request",
        "resumed",
        "scheduled_at",
        "status",
        "tokens",
    )

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.prompt_len = len(request.prompt)
        self.tokens: list[Token] = list(request.prompt)
        self.num_computed = 0
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.num_cached_blocks = 0
        self.status = _Status.WAITING
        self.resumed = False
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining_output(self) -> int:
        return self.request.max_tokens - self.num_output

    @property
    def prefill_remaining(self) -> int:
        """Tokens still to compute before this request can emit its next token, when that
        is more than a single decode token."""
        left = self.num_tokens - self.num_computed
        if left > 1 or self.num_computed < self.prompt_len:
            return left
        return 0


class Engine:
    """One model server's engine: `add` requests, call `step(now)` in a loop.

    `seed` makes the output words reproducible. Raises ValueError from `add` for a request
    the server would refuse (empty prompt, longer than the KV cache, LoRA without slots).
    """

    def __init__(self, profile: HardwareProfile, *, seed: int = 0) -> None:
        self.profile = profile
        self.histograms = EngineHistograms(max_model_len=profile.max_model_len)
        self._pool = BlockPool(profile.kv_blocks)
        self._rng = random.Random(seed)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._requests: dict[str, _Seq] = {}
        self._loaded: OrderedDict[str, None] = OrderedDict()
        self._stall_after: int | None = None
        self._adapter_loads = self._adapter_requests = self._adapter_hits = 0
        self._now = -math.inf
        self._steps = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished = dict.fromkeys(FinishReason, 0)
        self._lora_seen = False
        self._lora_info: dict[tuple[str, str], float] = {}

    def __repr__(self) -> str:
        return (
            f"<Engine {self.profile.name} running={len(self._running)} "
            f"waiting={len(self._waiting)} kv={self._pool.usage():.2f}>"
        )

    # -- requests --------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue a request (at the tail of the waiting queue)."""
        if request.request_id in self._requests:
            raise ValueError(f"Request {request.request_id!r} is already in the engine.")
        if not request.prompt:
            raise ValueError("The prompt is empty; a request needs at least one token.")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {request.max_tokens}.")
        total = len(request.prompt) + request.max_tokens
        if total > self.profile.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.profile.max_model_len} tokens. "
                f"However, you requested {total} tokens ({len(request.prompt)} in the "
                f"messages, {request.max_tokens} in the completion)."
            )
        if request.adapter is not None:
            if self.profile.max_loras < 1:
                raise ValueError(
                    f"LoRA adapter {request.adapter!r} requested from an engine without LoRA slots."
                )
            self._lora_seen = True
        self._requests[request.request_id] = _Seq(request)
        self._waiting.append(self._requests[request.request_id])

    def abort(self, request_id: str) -> bool:
        """Remove a request (the client went away) and free its blocks.

        Returns False if the engine does not hold it (it already finished, or never came).
        """
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is _Status.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._pool.free(seq.blocks)
        seq.blocks = []
        self._finished[FinishReason.ABORT] += 1
        return True

    def stall(self, after_tokens: int | None) -> None:
        """Wedge the engine: from now on a request that has `after_tokens` output tokens, or
        all but its last, is not scheduled (it stays where it is, with its KV blocks), so no
        request finishes. None lifts the stall: the stuck requests go on where they stopped."""
        if after_tokens is not None and after_tokens < 0:
            raise ValueError(f"after_tokens must not be negative, not {after_tokens}.")
        self._stall_after = after_tokens

    def _stalled(self, seq: _Seq) -> bool:
        cap = self._stall_after
        return cap is not None and seq.num_output >= min(cap, seq.request.max_tokens - 1)

    def has_work(self) -> bool:
        """Whether any request is waiting or running, other than stalled ones."""
        if self._stall_after is None:
            return bool(self._requests)
        return not all(self._stalled(seq) for seq in self._requests.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def cached_prefix_tokens(self, prompt: Sequence[Token], *, adapter: str | None) -> int:
        """How many of `prompt`'s tokens the prefix cache would serve right now.

        Like the scheduler, at most all but the last token: one token is always computed.
        """
        bs = self.profile.block_size
        usable = (len(prompt) - 1) // bs
        hashes = block_hashes(prompt[: usable * bs], block_size=bs, adapter=adapter)
        return len(self._pool.lookup(hashes)) * bs

    # -- the step ----------------------------------------------------------------------------

    def step(self, now: float) -> StepOutcome:
        """Schedule and run one step starting at `now`; return what it produced.

        The engine's state afterwards is the state at the step's end. An idle outcome
        (nothing schedulable: no requests, or only ones arriving after `now`) takes no time.
        """
        if now < self._now:
            raise ValueError(f"Engine time went backwards: {now} after {self._now}.")
        self._now = now
        profile = self.profile
        scheduled, preempted = self._schedule(now)
        if not scheduled:
            return StepOutcome(
                start=now,
                duration=0.0,
                tokens={},
                finished=(),
                preempted=tuple(s.request.request_id for s in preempted),
                scheduled_tokens=0,
                prefill_tokens=0,
                decode_seqs=0,
                context_tokens=0,
                adapters_loaded=(),
            )
        self._steps += 1
        loaded = self._load_adapters(scheduled)
        decode_seqs = prefill_tokens = context_tokens = 0
        for seq, n in scheduled:
            if n == 1 and seq.num_computed >= seq.prompt_len:
                decode_seqs += 1
                context_tokens += seq.num_computed + 1
            else:
                prefill_tokens += n
        duration = (
            profile.step_base_s
            + profile.step_per_seq_s * decode_seqs
            + profile.step_per_context_token_s * context_tokens
            + prefill_tokens / profile.prefill_tokens_per_s
            + profile.lora_load_s * len(loaded)
        )
        end = now + duration
        tokens, finished = self._advance(scheduled, end)
        scheduled_tokens = prefill_tokens + decode_seqs
        self.histograms.iteration_tokens.observe(scheduled_tokens)
        if self._lora_seen:
            key = (
                ",".join(self._adapters(self._running)),
                ",".join(self._adapters(self._waiting)),
            )
            self._lora_info[key] = end
        self._now = end
        return StepOutcome(
            start=now,
            duration=duration,
            tokens=tokens,
            finished=tuple(finished),
            preempted=tuple(s.request.request_id for s in preempted),
            scheduled_tokens=scheduled_tokens,
            prefill_tokens=prefill_tokens,
            decode_seqs=decode_seqs,
            context_tokens=context_tokens,
            adapters_loaded=tuple(loaded),
        )

    def _schedule(self, now: float) -> tuple[list[tuple[_Seq, int]], list[_Seq]]:
        profile = self.profile
        budget = profile.max_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        preempted: list[_Seq] = []
        running = self._running
        # Running requests first, in admission order; preempt from the tail when KV is short.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if self._stalled(seq):
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            ok = self._allocate(seq, seq.num_computed + n)
            while not ok:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                ok = self._allocate(seq, seq.num_computed + n)
            if not ok:
                break
            scheduled.append((seq, n))
            budget -= n
            i += 1
        if preempted:
            return scheduled, preempted
        # Then waiting requests, first come first served.
        loras = {s.request.adapter for s, _ in scheduled if s.request.adapter is not None}
        skipped: list[_Seq] = []
        waiting = self._waiting
        bs = profile.block_size
        while waiting and budget > 0 and len(running) < profile.max_num_seqs:
            seq = waiting[0]
            if self._stalled(seq):
                skipped.append(waiting.popleft())
                continue
            if seq.request.arrival > now:
                break
            adapter = seq.request.adapter
            if adapter is not None and adapter not in loras and len(loras) >= profile.max_loras:
                skipped.append(waiting.popleft())
                continue
            usable = (seq.num_tokens - 1) // bs
            self._ensure_hashes(seq, usable)
            hits = self._pool.lookup(seq.hashes[:usable])
            computed = len(hits) * bs
            n = min(seq.num_tokens - computed, budget)
            if not self._allocate(seq, computed + n, hits=hits):
                break
            waiting.popleft()
            seq.num_computed = computed
            seq.num_cached_blocks = len(hits)
            seq.status = _Status.RUNNING
            running.append(seq)
            if not seq.resumed:
                self._prefix_queries += seq.num_tokens
                self._prefix_hits += computed
            if seq.scheduled_at is None:
                seq.scheduled_at = now
            if adapter is not None:
                loras.add(adapter)
            scheduled.append((seq, n))
            budget -= n
        waiting.extendleft(reversed(skipped))
        return scheduled, preempted

    def _allocate(self, seq: _Seq, total_tokens: int, *, hits: Sequence[int] = ()) -> bool:
        """Give `seq` blocks for `total_tokens` tokens, reusing cached `hits` first."""
        pool = self._pool
        bs = self.profile.block_size
        need = -(-total_tokens // bs) - len(seq.blocks) - len(hits)
        if need <= 0 and not hits:
            return True
        need = max(need, 0)
        if not pool.can_allocate(need, hits):
            return False
        pool.touch(hits)
        seq.blocks.extend(hits)
        seq.blocks.extend(pool.allocate(need))
        return True

    def _preempt(self, seq: _Seq) -> None:
        self._pool.free(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        seq.status = _Status.WAITING
        seq.resumed = True
        self._preemptions += 1
        self._waiting.appendleft(seq)

    def _load_adapters(self, scheduled: list[tuple[_Seq, int]]) -> list[str]:
        """Make the batch's adapters resident; return those that had to be loaded."""
        batch: dict[str, None] = {}
        for seq, _ in scheduled:
            if seq.request.adapter is not None:
                batch[seq.request.adapter] = None
        for seq, _ in scheduled:
            adapter = seq.request.adapter
            if adapter is not None and seq.num_computed == 0 and not seq.resumed:
                # A request's first schedule: did it find its adapter already resident?
                self._adapter_requests += 1
                self._adapter_hits += adapter in self._loaded
        loaded: list[str] = []
        for adapter in batch:
            if adapter in self._loaded:
                self._loaded.move_to_end(adapter)
                continue
            if len(self._loaded) >= self.profile.max_loras:
                victim = next(a for a in self._loaded if a not in batch)
                del self._loaded[victim]
            self._loaded[adapter] = None
            loaded.append(adapter)
        self._adapter_loads += len(loaded)
        return loaded

    def _advance(
        self, scheduled: list[tuple[_Seq, int]], end: float
    ) -> tuple[dict[str, str], list[str]]:
        """Apply a step's computation: cache full blocks, emit tokens, finish requests."""
        tokens: dict[str, str] = {}
        finished: list[str] = []
        h = self.histograms
        vocabulary = _VOCABULARY
        for seq, n in scheduled:
            seq.num_computed += n
            self._cache_full_blocks(seq)
            if seq.num_computed < seq.num_tokens:
                continue  # a prompt chunk: no token yet
            word = vocabulary[self._rng.randrange(len(vocabulary))]
            seq.tokens.append(word)
            request = seq.request
            tokens[request.request_id] = word
            self._generation_tokens += 1
            if seq.first_token_at is None:
                seq.first_token_at = end
                self._prompt_tokens += seq.prompt_len
                h.time_to_first_token.observe(end - request.arrival)
            else:
                h.inter_token_latency.observe(end - seq.last_token_at)
            seq.last_token_at = end
            if seq.num_output >= request.max_tokens:
                finished.append(request.request_id)
                self._finish(seq, end)
        if finished:
            self._running = [s for s in self._running if s.request.request_id in self._requests]
        return tokens, finished

    def _finish(self, seq: _Seq, end: float) -> None:
        del self._requests[seq.request.request_id]
        self._pool.free(seq.blocks)
        seq.blocks = []
        self._finished[FinishReason.LENGTH] += 1
        request = seq.request
        h = self.histograms
        scheduled_at = seq.scheduled_at if seq.scheduled_at is not None else request.arrival
        first = seq.first_token_at if seq.first_token_at is not None else end
        h.e2e_request_latency.observe(end - request.arrival)
        h.request_queue_time.observe(scheduled_at - request.arrival)
        h.request_prefill_time.observe(first - scheduled_at)
        h.request_decode_time.observe(end - first)
        h.request_inference_time.observe(end - scheduled_at)
        h.time_per_prefill_token.observe((first - scheduled_at) / seq.prompt_len)
        if seq.num_output > 1:
            h.request_time_per_output_token.observe((end - first) / (seq.num_output - 1))
        h.request_prompt_tokens.observe(seq.prompt_len)
        h.request_generation_tokens.observe(seq.num_output)
        h.request_max_num_generation_tokens.observe(request.max_tokens)
        h.request_params_max_tokens.observe(request.max_tokens)
        h.request_params_n.observe(1)

    def _ensure_hashes(self, seq: _Seq, count: int) -> None:
        have = len(seq.hashes)
        if have >= count:
            return
        bs = self.profile.block_size
        seq.hashes.extend(
            block_hashes(
                seq.tokens[have * bs : count * bs],
                block_size=bs,
                adapter=seq.request.adapter,
                parent=seq.hashes[-1] if seq.hashes else None,
            )
        )

    def _cache_full_blocks(self, seq: _Seq) -> None:
        full = seq.num_computed // self.profile.block_size
        if full <= seq.num_cached_blocks:
            return
        self._ensure_hashes(seq, full)
        for index in range(seq.num_cached_blocks, full):
            self._pool.cache(seq.blocks[index], seq.hashes[index])
        seq.num_cached_blocks = full

    # -- state ---------------------------------------------------------------------------------

    @staticmethod
    def _adapters(seqs: Sequence[_Seq] | deque[_Seq]) -> tuple[str, ...]:
        return tuple(sorted({s.request.adapter for s in seqs if s.request.adapter is not None}))

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def kv_usage(self) -> float:
        return self._pool.usage()

    def state(self) -> EngineState:
        """A frozen, exact copy of everything observable (see `EngineState`)."""
        bs = self.profile.block_size
        queued = 0
        for seq in self._waiting:
            usable = (seq.num_tokens - 1) // bs
            self._ensure_hashes(seq, usable)
            queued += seq.num_tokens - len(self._pool.lookup(seq.hashes[:usable])) * bs
        adapter_remaining: dict[str, int] = {}
        context = prefilling = 0
        for seq in self._running:
            left = seq.prefill_remaining
            queued += left
            prefilling += left > 0
            context += seq.num_computed
            adapter = seq.request.adapter
            if adapter is not None:
                adapter_remaining[adapter] = max(
                    adapter_remaining.get(adapter, 0), seq.remaining_output
                )
        return EngineState(
            time=self._now,
            steps=self._steps,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_prefilling=prefilling,
            kv_usage=self._pool.usage(),
            kv_blocks=self._pool.num_blocks,
            kv_blocks_used=self._pool.num_used,
            kv_blocks_cached_free=self._pool.num_cached_free,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            preemptions=self._preemptions,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            finished=dict(self._finished),
            running_adapters=self._adapters(self._running),
            waiting_adapters=self._adapters(self._waiting),
            loaded_adapters=tuple(self._loaded),
            adapter_loads=self._adapter_loads,
            adapter_requests=self._adapter_requests,
            adapter_hits=self._adapter_hits,
            queued_prefill_tokens=queued,
            waiting_prompt_tokens=sum(seq.prompt_len for seq in self._waiting),
            running_context_tokens=context,
            running_remaining_tokens=tuple(sorted(s.remaining_output for s in self._running)),
            adapter_remaining_tokens=adapter_remaining,
            lora_info=tuple((r, w, t) for (r, w), t in self._lora_info.items()),
        )
