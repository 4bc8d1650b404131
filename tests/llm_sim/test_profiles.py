"""Hardware profiles and the analytic capacity estimate, checked against the engine itself."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from llm_sim.engine import Engine, EngineRequest
from llm_sim.profiles import A10G, H100, HardwareProfile, nominal_capacity


def test_h100_sustains_a_few_chat_requests_per_second() -> None:
    capacity = nominal_capacity(H100, prompt_tokens=500, output_tokens=150)
    assert 3.0 <= capacity.requests_per_s <= 5.0
    assert capacity.concurrency == H100.max_num_seqs
    assert 32 <= H100.max_num_seqs <= 64
    assert capacity.output_tokens_per_s == pytest.approx(150 * capacity.requests_per_s)


@pytest.mark.parametrize(("prompt", "output"), [(500, 150), (400, 200), (600, 120), (300, 300)])
def test_a10g_is_ten_to_fifteen_times_slower_on_chat_requests(prompt: int, output: int) -> None:
    """Chat-like shapes; the spread is the A10G's KV cache (12x smaller) times its speed, so
    tiny requests are ~6x apart and long ones ~20x, as on real GPUs."""
    h100 = nominal_capacity(H100, prompt_tokens=prompt, output_tokens=output)
    a10g = nominal_capacity(A10G, prompt_tokens=prompt, output_tokens=output)
    assert 10 <= h100.requests_per_s / a10g.requests_per_s <= 15


def test_profile_ratios_follow_the_public_figures() -> None:
    def decode_step(profile: HardwareProfile, batch: int, context: int) -> float:
        return (
            profile.step_base_s
            + profile.step_per_seq_s * batch
            + profile.step_per_context_token_s * batch * context
        )

    assert 4.5 <= decode_step(A10G, 1, 600) / decode_step(H100, 1, 600) <= 5.5
    assert 4.0 <= decode_step(A10G, 64, 600) / decode_step(H100, 64, 600) <= 5.5
    assert 7 <= H100.prefill_tokens_per_s / A10G.prefill_tokens_per_s <= 9
    assert 11 <= H100.kv_blocks / A10G.kv_blocks <= 13
    # The A10G's batch is capped by its KV cache, the H100's by max_num_seqs.
    assert nominal_capacity(A10G, prompt_tokens=500, output_tokens=150).concurrency < 16


def test_scaled_divides_capacity_and_keeps_the_batch() -> None:
    slow = H100.scaled(4.0)
    assert slow.step_base_s == pytest.approx(4 * H100.step_base_s)
    assert slow.prefill_tokens_per_s == pytest.approx(H100.prefill_tokens_per_s / 4)
    assert slow.lora_load_s == pytest.approx(4 * H100.lora_load_s)
    assert (slow.kv_blocks, slow.max_num_seqs, slow.name) == (H100.kv_blocks, 48, "H100")
    base = nominal_capacity(H100, prompt_tokens=500, output_tokens=150)
    scaled = nominal_capacity(slow, prompt_tokens=500, output_tokens=150)
    assert scaled.requests_per_s == pytest.approx(base.requests_per_s / 4)
    assert scaled.concurrency == base.concurrency
    with pytest.raises(ValueError, match="time_scale"):
        H100.scaled(0)


def test_invalid_profiles_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_blocks"):
        dataclasses.replace(H100, kv_blocks=0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        dataclasses.replace(H100, prefill_tokens_per_s=0.0)
    with pytest.raises(ValueError, match="does not fit"):
        nominal_capacity(A10G, prompt_tokens=A10G.max_model_len, output_tokens=1)
    with pytest.raises(ValueError, match="at least one"):
        nominal_capacity(H100, prompt_tokens=0, output_tokens=1)


def engine_capacity(profile: HardwareProfile, *, prompt: int, output: int) -> float:
    """Completed requests/s of the bare engine, saturated (closed loop), on a virtual clock."""
    engine = Engine(profile, seed=0)
    ids = itertools.count()
    nominal = nominal_capacity(profile, prompt_tokens=prompt, output_tokens=output)
    lifetime = nominal.concurrency / nominal.requests_per_s

    def add(now: float) -> None:
        i = next(ids)
        words = tuple(f"r{i}w{k}" for k in range(prompt))
        engine.add(EngineRequest(request_id=str(i), prompt=words, max_tokens=output, arrival=now))

    for _ in range(profile.max_num_seqs + 16):
        add(0.0)
    now, done = 0.0, 0
    warm, end = 3 * lifetime, 10 * lifetime
    while now < end:
        outcome = engine.step(now)
        now = outcome.end
        for _ in outcome.finished:
            add(now)
            done += now >= warm
    return done / (now - warm)


@pytest.mark.parametrize(
    ("profile", "prompt", "output", "tolerance"),
    [
        (H100, 500, 150, 0.03),
        (H100, 200, 50, 0.03),
        (H100, 2000, 100, 0.03),  # KV-bound on the H100 too
        (A10G, 500, 150, 0.06),  # KV-bound: preemptions cost a few percent
    ],
)
def test_nominal_capacity_matches_the_engine(
    profile: HardwareProfile, prompt: int, output: int, tolerance: float
) -> None:
    nominal = nominal_capacity(profile, prompt_tokens=prompt, output_tokens=output)
    measured = engine_capacity(profile, prompt=prompt, output=output)
    assert measured == pytest.approx(nominal.requests_per_s, rel=tolerance)
