"""The pure engine, driven with explicit times: scheduling limits, preemption, prefix cache,
LoRA slots and the step-time formula, each checked against vLLM v1's rules."""

from __future__ import annotations

import dataclasses
import random

import pytest

from llm_sim.engine import Engine, EngineRequest, FinishReason, StepOutcome
from llm_sim.profiles import H100, HardwareProfile

SMALL = HardwareProfile(
    name="small",
    step_base_s=0.01,
    step_per_seq_s=0.001,
    step_per_context_token_s=1e-5,
    prefill_tokens_per_s=1000.0,
    kv_blocks=1000,
    max_num_seqs=4,
    max_batched_tokens=64,
    max_loras=1,
    lora_load_s=0.5,
)


def request(
    rid: str,
    prompt: int | tuple[str, ...],
    max_tokens: int,
    *,
    adapter: str | None = None,
    arrival: float = 0.0,
) -> EngineRequest:
    words = prompt if isinstance(prompt, tuple) else tuple(f"{rid}-{k}" for k in range(prompt))
    return EngineRequest(
        request_id=rid, prompt=words, max_tokens=max_tokens, adapter=adapter, arrival=arrival
    )


def run(
    engine: Engine, now: float = 0.0, *, limit: int = 100_000
) -> tuple[list[StepOutcome], float]:
    """Step until the engine is empty; return the outcomes and the final time."""
    outcomes: list[StepOutcome] = []
    for _ in range(limit):
        if not engine.has_work():
            return outcomes, now
        outcome = engine.step(now)
        assert not outcome.idle
        outcomes.append(outcome)
        now = outcome.end
    raise AssertionError("The engine did not drain.")


def test_batch_never_exceeds_max_num_seqs_nor_the_token_budget() -> None:
    engine = Engine(SMALL, seed=1)
    rng = random.Random(7)
    lengths = {}
    for i in range(30):
        lengths[f"r{i}"] = rng.randint(1, 40)
        engine.add(request(f"r{i}", rng.randint(1, 150), lengths[f"r{i}"]))
    produced: dict[str, int] = dict.fromkeys(lengths, 0)
    chunked = False
    now = 0.0
    while engine.has_work():
        outcome = engine.step(now)
        assert outcome.scheduled_tokens <= SMALL.max_batched_tokens
        assert engine.num_running <= SMALL.max_num_seqs
        assert len(outcome.tokens) <= SMALL.max_num_seqs
        chunked |= outcome.prefill_tokens == SMALL.max_batched_tokens - outcome.decode_seqs
        for rid in outcome.tokens:
            produced[rid] += 1
        now = outcome.end
    assert produced == lengths
    assert chunked, "long prompts should have been prefilled in budget-sized chunks"
    state = engine.state()
    assert state.finished[FinishReason.LENGTH] == 30
    assert state.generation_tokens_total == sum(lengths.values())
    assert state.kv_usage == 0.0
    assert state.preemptions == 0


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    engine = Engine(dataclasses.replace(SMALL, max_num_seqs=8), seed=1)
    engine.add(request("long", 200, 3))
    engine.add(request("next", 10, 3))
    first = engine.step(0.0)
    # The long prompt takes the whole 64-token budget; the next one waits.
    assert (first.prefill_tokens, first.tokens, engine.num_waiting) == (64, {}, 1)
    second = engine.step(first.end)
    assert second.prefill_tokens == 64 and engine.num_waiting == 1
    third = engine.step(second.end)
    assert third.prefill_tokens == 64 and engine.num_waiting == 1
    # 200 = 3 * 64 + 8: the last chunk leaves room for the next request's whole prompt.
    fourth = engine.step(third.end)
    assert fourth.prefill_tokens == 8 + 10
    assert set(fourth.tokens) == {"long", "next"}


def test_step_time_is_the_profile_formula() -> None:
    engine = Engine(SMALL, seed=1)
    engine.add(request("a", 20, 5))
    engine.add(request("b", 30, 5))
    prefill = engine.step(0.0)
    assert prefill.duration == pytest.approx(SMALL.step_base_s + 50 / 1000)
    assert set(prefill.tokens) == {"a", "b"}
    decode = engine.step(prefill.end)
    # Two decoding sequences attending to 21 and 31 tokens.
    assert (decode.decode_seqs, decode.context_tokens, decode.prefill_tokens) == (2, 52, 0)
    assert decode.duration == pytest.approx(0.01 + 2 * 0.001 + 52 * 1e-5)


def test_a_request_is_not_scheduled_before_it_arrives() -> None:
    engine = Engine(SMALL, seed=1)
    engine.add(request("later", 5, 1, arrival=1.0))
    assert engine.step(0.5).idle
    outcome = engine.step(1.0)
    assert outcome.tokens.keys() == {"later"}
    ttft = engine.histograms.time_to_first_token
    assert (ttft.count, ttft.sum) == (1, pytest.approx(outcome.duration))


def test_kv_exhaustion_preempts_the_newest_request_and_recomputes_it() -> None:
    tiny = dataclasses.replace(SMALL, kv_blocks=10, max_batched_tokens=512, max_num_seqs=8)
    engine = Engine(tiny, seed=1)
    for rid in ("old", "mid", "new"):
        engine.add(request(rid, 40, 60))  # 3 blocks each to start, 7 at the end
    first = engine.step(0.0)
    assert engine.num_running == 3 and engine.state().kv_blocks_used == 9
    outcomes, _ = run(engine, first.end)
    preempted = [rid for o in outcomes for rid in o.preempted]
    assert preempted[0] == "new"
    state = engine.state()
    assert state.preemptions == len(preempted) > 0
    assert state.finished[FinishReason.LENGTH] == 3
    # Every request still produced exactly its tokens (nothing re-emitted after recompute).
    counts: dict[str, int] = {}
    for outcome in [first, *outcomes]:
        for rid in outcome.tokens:
            counts[rid] = counts.get(rid, 0) + 1
    assert counts == {"old": 60, "mid": 60, "new": 60}
    # A resumed request recomputes its prompt and the tokens it had produced.
    resumed = next(o for o in outcomes if o.prefill_tokens > 0)
    assert resumed.prefill_tokens > 40
    assert state.kv_usage == 0.0


def test_a_preempted_request_goes_back_to_the_head_of_the_queue() -> None:
    tiny = dataclasses.replace(SMALL, kv_blocks=6, max_batched_tokens=512, max_num_seqs=8)
    engine = Engine(tiny, seed=1)
    engine.add(request("a", 32, 40))
    engine.add(request("b", 32, 40))
    now = 0.0
    while True:  # both grow one block per 16 tokens until the 6 blocks run out
        outcome = engine.step(now)
        now = outcome.end
        if outcome.preempted:
            break
    assert outcome.preempted == ("b",)  # the newest running request
    # "d" would fit, but "b" is back at the head of the queue and first come, first served.
    engine.add(request("d", 8, 1, arrival=now))
    first_token: dict[str, float] = {}
    while engine.has_work():
        outcome = engine.step(now)
        now = outcome.end
        for rid in outcome.tokens:
            first_token.setdefault(rid, now)
        if "a" in engine:
            assert "d" not in outcome.tokens
    assert first_token["b"] <= first_token["d"]


def test_prefix_cache_hits_skip_prefill_and_shorten_the_step() -> None:
    engine = Engine(H100, seed=1)
    shared = tuple(f"system-{k}" for k in range(64))
    engine.add(request("first", (*shared, "question", "one"), 1))
    cold = engine.step(0.0)
    assert cold.prefill_tokens == 66
    engine.add(request("second", (*shared, "question", "two"), 1, arrival=cold.end))
    warm = engine.step(cold.end)
    assert warm.prefill_tokens == 2  # 64 tokens (four full blocks) came from the cache
    assert cold.duration - warm.duration == pytest.approx(64 / H100.prefill_tokens_per_s)
    state = engine.state()
    assert (state.prefix_cache_queries, state.prefix_cache_hits) == (132, 64)
    assert engine.cached_prefix_tokens((*shared, "x"), adapter=None) == 64
    # Another adapter's blocks never match: the adapter is part of the block hash.
    assert engine.cached_prefix_tokens((*shared, "x"), adapter="lora-a") == 0


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    engine = Engine(H100, seed=1)
    prompt = tuple(f"w{k}" for k in range(32))
    engine.add(request("a", prompt, 1))
    now = engine.step(0.0).end
    engine.add(request("b", prompt, 1, arrival=now))
    outcome = engine.step(now)
    # Two full blocks are cached, but only the first may be reused: one token is computed.
    assert outcome.prefill_tokens == 16
    assert engine.state().prefix_cache_hits == 16


def test_freed_blocks_stay_cached_until_evicted() -> None:
    tiny = dataclasses.replace(H100, kv_blocks=8)
    engine = Engine(tiny, seed=1)
    engine.add(request("a", 64, 1))  # 4 full blocks, freed with their hashes
    _, now = run(engine)
    assert engine.state().kv_blocks_cached_free == 4
    assert engine.cached_prefix_tokens(tuple(f"a-{k}" for k in range(65)), adapter=None) == 64
    engine.add(request("b", 96, 1, arrival=now))  # needs 6 of 8 blocks: evicts cached ones
    run(engine, now)
    assert engine.cached_prefix_tokens(tuple(f"a-{k}" for k in range(65)), adapter=None) < 64


def test_lora_slots_are_respected_and_a_skipped_request_does_not_block_others() -> None:
    engine = Engine(SMALL, seed=1)  # max_loras=1
    engine.add(request("a1-first", 4, 3, adapter="a1"))
    engine.add(request("a2", 4, 3, adapter="a2"))
    engine.add(request("a1-second", 4, 3, adapter="a1"))
    engine.add(request("base", 4, 3))
    first = engine.step(0.0)
    assert set(first.tokens) == {"a1-first", "a1-second", "base"}
    assert first.adapters_loaded == ("a1",)
    assert first.duration == pytest.approx(0.01 + 12 / 1000 + SMALL.lora_load_s)
    state = engine.state()
    assert (state.running_adapters, state.waiting_adapters) == (("a1",), ("a2",))
    outcomes, _ = run(engine, first.end)
    adapter_of = {"a1-first": "a1", "a1-second": "a1", "a2": "a2", "base": None}
    for outcome in outcomes:
        adapters = {adapter_of[rid] for rid in outcome.tokens} - {None}
        assert len(adapters) <= SMALL.max_loras
    # a2 runs once a1's requests are done, and pays for loading into the slot.
    a2_first = next(o for o in outcomes if "a2" in o.tokens)
    assert a2_first.adapters_loaded == ("a2",)
    assert engine.state().loaded_adapters == ("a2",)
    # Two loads (a1, then a2); of the three adapter requests none found its adapter resident
    # at its first schedule (a1's two were scheduled in the step that loaded a1).
    state = engine.state()
    assert (state.adapter_loads, state.adapter_requests, state.adapter_hits) == (2, 3, 0)
    engine.add(request("a2-again", 4, 3, adapter="a2"))
    run(engine, 100.0)
    state = engine.state()
    assert (state.adapter_loads, state.adapter_requests, state.adapter_hits) == (2, 4, 1)


def test_lora_info_history_keeps_old_adapter_sets() -> None:
    engine = Engine(SMALL, seed=1)
    engine.add(request("base", 4, 2))
    _, now = run(engine)
    assert engine.state().lora_info == ()  # nothing before the first LoRA request
    engine.add(request("x", 4, 2, adapter="a1", arrival=now))
    engine.add(request("y", 4, 2, adapter="a2", arrival=now))
    run(engine, now)
    info = engine.state().lora_info
    sets = {(running, waiting) for running, waiting, _ in info}
    assert ("a1", "a2") in sets and ("a2", "") in sets and ("", "") in sets
    latest = max(info, key=lambda item: item[2])
    assert latest[:2] == ("", "")


def test_abort_frees_the_requests_blocks() -> None:
    engine = Engine(H100, seed=1)
    engine.add(request("a", 100, 50))
    engine.add(request("queued", 10, 5, arrival=5.0))
    engine.step(0.0)
    assert engine.state().kv_blocks_used == 7
    assert engine.abort("a") and engine.abort("queued")
    assert not engine.abort("a")
    state = engine.state()
    assert (state.kv_blocks_used, state.num_running, state.num_waiting) == (0, 0, 0)
    assert state.finished[FinishReason.ABORT] == 2


def test_requests_the_server_would_refuse() -> None:
    engine = Engine(dataclasses.replace(SMALL, max_loras=0), seed=1)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add(request("huge", SMALL.max_model_len, 1))
    with pytest.raises(ValueError, match="empty"):
        engine.add(request("empty", (), 1))
    with pytest.raises(ValueError, match="LoRA"):
        engine.add(request("lora", 3, 1, adapter="a1"))
    engine.add(request("ok", 3, 1))
    with pytest.raises(ValueError, match="already"):
        engine.add(request("ok", 3, 1))
    with pytest.raises(ValueError, match="backwards"):
        engine.step(1.0)
        engine.step(0.5)


def test_histograms_follow_each_request() -> None:
    engine = Engine(SMALL, seed=1)
    engine.add(request("a", 10, 4))
    outcomes, end = run(engine)
    h = engine.histograms
    assert h.time_to_first_token.sum == pytest.approx(outcomes[0].end)
    assert h.e2e_request_latency.sum == pytest.approx(end)
    assert h.inter_token_latency.count == 3
    assert h.request_prompt_tokens.sum == 10 and h.request_generation_tokens.sum == 4
    assert h.iteration_tokens.count == 4
    # Same seed, same words.
    again = Engine(SMALL, seed=1)
    again.add(request("a", 10, 4))
    assert [o.tokens for o in run(again)[0]] == [o.tokens for o in outcomes]


def test_a_stall_keeps_requests_in_place_unfinished_until_lifted() -> None:
    engine = Engine(SMALL)
    engine.stall(2)
    engine.add(request("a", 20, 10))
    engine.add(request("b", 20, 2))  # two tokens: a stall stops it short of its last
    engine.add(request("c", 20, 1))  # a single token: it never gets a seat
    outcomes, now = run(engine)
    assert sum(o.tokens.get("a") is not None for o in outcomes) == 2
    assert sum(o.tokens.get("b") is not None for o in outcomes) == 1
    assert all("c" not in o.tokens and not o.finished for o in outcomes)
    state = engine.state()
    assert (state.num_running, state.num_waiting) == (2, 1)
    assert state.running_remaining_tokens == (1, 8) and state.kv_blocks_used > 0
    engine.stall(None)
    outcomes, _ = run(engine, now)
    assert sorted(r for o in outcomes for r in o.finished) == ["a", "b", "c"]
    assert engine.state().finished[FinishReason.LENGTH] == 3
