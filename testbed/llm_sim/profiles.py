"""Hardware profiles for simulated GPU pods, and what a profile can sustain.

A profile is the handful of numbers the engine's step-time model needs
(`d0 + d_b·n_decode + c·Σcontext + n_prefill/P`, see `engine.py`) plus the scheduler limits
a vLLM server is started with. The two profiles keep the public ratios between an
H100-80GB and an A10G-24GB serving Llama-3.1-8B (DESIGN.md, "Simulating GPU pods"): a decode
step ~5x slower, prefill ~7.5x slower and ~12x fewer KV blocks on the A10G, so a fleet of both
has the 10-15x spread in sustainable request rate that makes routing matter. The spread
depends on the request, as on real GPUs: it comes from the A10G's smaller KV cache as much
as from its speed, so chat-like requests (a few hundred tokens each way) are 12-14x apart,
tiny ones ~6x (the A10G's batch is not KV-bound) and long ones ~20x.

The absolute numbers are scaled down so a whole scenario (Envoy, the pods, a load generator)
fits on a 2-core machine: every step of every pod is an asyncio wake-up and every streamed
token an HTTP write through Envoy. Steps are ~4.6x slower than the real GPUs, and
`max_num_seqs` is 48 rather than vLLM's 256, with KV scaled by about the same factor so the
cache is as contended as on a real pod. The H100 profile sustains ~4.6 requests/s of a
500-token-prompt, 150-token-output chat request; `nominal_capacity` says exactly how much.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["A10G", "Capacity", "H100", "HardwareProfile", "nominal_capacity"]


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """The speed and limits of one simulated model server.

    Durations are seconds. `step_base_s` (d0) is a step's fixed cost, `step_per_seq_s` (d_b)
    the cost of each decoding sequence in the batch, `step_per_context_token_s` (c) the cost
    of each context token those sequences attend to, and `prefill_tokens_per_s` (P) the rate
    at which prompt tokens are computed. `kv_blocks` of `block_size` tokens hold the KV cache
    (and the prefix cache, in the blocks nobody uses). `max_num_seqs` caps the running batch,
    `max_batched_tokens` the tokens computed in one step (chunked prefill), `max_loras` the
    LoRA adapters one batch may use, and `lora_load_s` the time to load an adapter into a
    free slot.
    """

    name: str
    step_base_s: float
    step_per_seq_s: float
    step_per_context_token_s: float
    prefill_tokens_per_s: float
    kv_blocks: int
    block_size: int = 16
    max_num_seqs: int
    max_batched_tokens: int
    max_loras: int
    lora_load_s: float

    def __post_init__(self) -> None:
        for field in ("step_base_s", "prefill_tokens_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must be positive.")
        for field in ("step_per_seq_s", "step_per_context_token_s", "lora_load_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must not be negative.")
        for field in ("kv_blocks", "block_size", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must be at least 1.")
        if self.max_loras < 0:
            raise ValueError(f"HardwareProfile {self.name!r}: max_loras must not be negative.")

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt plus output) the pod accepts: its whole KV cache."""
        return self.kv_blocks * self.block_size

    def scaled(self, time_scale: float) -> HardwareProfile:
        """The same hardware running `time_scale` times slower (>1) or faster (<1).

        Every duration is multiplied and the prefill rate divided, so capacities in
        requests/s divide by `time_scale` while batch sizes and KV pressure stay the same.
        """
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, not {time_scale!r}.")
        return dataclasses.replace(
            self,
            step_base_s=self.step_base_s * time_scale,
            step_per_seq_s=self.step_per_seq_s * time_scale,
            step_per_context_token_s=self.step_per_context_token_s * time_scale,
            prefill_tokens_per_s=self.prefill_tokens_per_s / time_scale,
            lora_load_s=self.lora_load_s * time_scale,
        )


# Real H100 (Llama-3.1-8B): ~6.5 ms/step at batch 1, ~10 ms at 64, prefill 25-35k tok/s,
# ~27k blocks. Scaled: 30 ms at batch 1, ~47 ms at 64 with 600-token contexts, 6k tok/s.
H100 = HardwareProfile(
    name="H100",
    step_base_s=0.030,
    step_per_seq_s=0.00015,
    step_per_context_token_s=2.0e-7,
    prefill_tokens_per_s=6000.0,
    kv_blocks=5000,
    max_num_seqs=48,
    max_batched_tokens=2048,
    max_loras=4,
    lora_load_s=0.1,
)

# Real A10G: ~34 ms/step at batch 1, ~45-50 ms at 64, prefill 3.5-5k tok/s, ~2.1k blocks.
# Scaled by the same factor: d0 5.2x the H100's, the per-sequence slope ~4x, prefill 7.5x
# slower, 12x fewer blocks (so KV, not max_num_seqs, caps its batch: ~11 chat requests).
A10G = HardwareProfile(
    name="A10G",
    step_base_s=0.156,
    step_per_seq_s=0.0005,
    step_per_context_token_s=7.8e-7,
    prefill_tokens_per_s=800.0,
    kv_blocks=416,
    max_num_seqs=48,
    max_batched_tokens=2048,
    max_loras=2,
    lora_load_s=0.2,
)


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """A steady-state throughput estimate: completed requests and output tokens per second,
    and the average number of requests running at once."""

    requests_per_s: float
    output_tokens_per_s: float
    concurrency: float


def nominal_capacity(
    profile: HardwareProfile, *, prompt_tokens: int, output_tokens: int
) -> Capacity:
    """What `profile` sustains when every request has this shape and the queue never empties.

    An analytic steady state that follows the engine's mechanics (no prefix-cache hits, no
    LoRA), for a prompt of p tokens and o output tokens:

    - Concurrency N is `max_num_seqs` unless the KV cache runs out first. A request holds
      `ceil((p + k)/block_size)` blocks after k output tokens, about
      `(p + o/2)/block_size + 1/2` averaged over its life, and the scheduler keeps admitting
      until the blocks are used up, so a KV-bound N is `kv_blocks` over that average.
    - A request holds its slot for `o` steps when its prompt fits the token budget next to
      the decodes (the step that completes the prefill emits the first token), or for
      `k_p + o - 1` steps when the prefill takes `k_p` chunks.
    - Per step, on average: `n_dec = N·(o-1)/(k_p+o-1)` decoding sequences attending to
      `p + o/2` context tokens each, and `N/(k_p+o-1)` prompts of p tokens prefilled, so the
      mean step is `d0 + d_b·n_dec + c·n_dec·(p + o/2) + (N/(k_p+o-1))·p/P`. The step time
      is linear in all of these, so the mean step is the mean of the steps, however the
      requests' phases line up: the estimate holds for waves as well as for smooth load.
    - Throughput is `N/(k_p+o-1)` requests per step, unless the token budget the decodes
      leave cannot prefill that many prompts; then prefill is the bottleneck.

    Against the engine itself (fake clock, closed loop), this is within ~2% when
    `max_num_seqs` is the limit (every H100 shape tried). In the KV-bound regime (the A10G)
    it is optimistic by ~3-5% for chat shapes and up to ~13% for long outputs on short
    prompts: it does not model preemptions, which the greedy admission causes there (the
    newest request is evicted and its prompt and output recomputed; 0.2 preemptions per
    completed 500/150 request on the A10G, 3.6 for 50/500).
    """
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("A request needs at least one prompt token and one output token.")
    p, o = prompt_tokens, output_tokens
    if p + o > profile.max_model_len:
        raise ValueError(
            f"A {p}+{o}-token request does not fit {profile.name}'s "
            f"{profile.max_model_len}-token KV cache."
        )
    mean_blocks = (p + o / 2) / profile.block_size + 0.5
    n = min(float(profile.max_num_seqs), profile.kv_blocks / mean_blocks)
    budget = profile.max_batched_tokens
    prefill_steps = max(1, math.ceil(p / max(1.0, budget - n)))
    slot_steps = prefill_steps + o - 1
    per_step = n / slot_steps
    decoding = n * (o - 1) / slot_steps
    if per_step * p > budget - decoding:
        # The budget left by the decodes cannot keep the slots filled.
        per_step = max(1.0, budget - decoding) / p
    step = (
        profile.step_base_s
        + profile.step_per_seq_s * decoding
        + profile.step_per_context_token_s * decoding * (p + o / 2)
        + per_step * p / profile.prefill_tokens_per_s
    )
    requests_per_s = per_step / step
    return Capacity(
        requests_per_s=requests_per_s,
        output_tokens_per_s=requests_per_s * o,
        concurrency=n,
    )
