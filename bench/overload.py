"""Scenario f (overload): the figures flow control is judged by, from a replay's results.

The trace runs at half the fleet's capacity, then ramps to twice it. What is asked of the
project (issue: flow control): no Critical refusal; Critical P99 TTFT in the overload at
most 1.5x its value at half load; Sheddable refused before Standard; a Retry-After on every
429; no 5xx; goodput (output tokens per second of admitted requests, during the overload)
at least 90% of the fleet's capacity, which single-pod saturation probes measure.

`critical_ttft_p99_ratio` divides Critical's P99 in the overload by the P99 of every
request at half load (see `overload_figures`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.loadgen import RequestResult
from llm_sim.loadgen.stats import percentile, ttft_sample
from llm_sim.probe import saturation_probe

__all__ = ["Windows", "fleet_capacity_tokens_per_s", "overload_figures"]

_TOO_MANY_REQUESTS = 429


@dataclass(frozen=True, kw_only=True)
class Windows:
    """Trace-time windows (seconds from the trace's start) where load is steady."""

    half_load: tuple[float, float]
    overload: tuple[float, float]


def _scheduled_in(result: RequestResult, window: tuple[float, float]) -> bool:
    return window[0] <= result.scheduled_at_s < window[1]


def _tokens_in(result: RequestResult, window: tuple[float, float]) -> float:
    """A complete response's output tokens that arrived inside `window`, taking them as
    spread evenly from its first token to its end."""
    if not result.ok or result.ttft_s is None or result.e2e_s is None:
        return 0.0
    sent = result.scheduled_at_s + result.lateness_s
    first, last = sent + result.ttft_s, sent + result.e2e_s
    if last <= first:
        return float(result.output_tokens) if window[0] <= first < window[1] else 0.0
    overlap = max(0.0, min(last, window[1]) - max(first, window[0]))
    return result.output_tokens * overlap / (last - first)


def overload_figures(results: Sequence[RequestResult], *, windows: Windows) -> dict[str, Any]:
    """Per band and window, what scenario f reports (see the module docstring)."""
    bands = sorted({r.band for r in results})
    refused = [r for r in results if r.status == _TOO_MANY_REQUESTS]
    first_refusal = {
        band: min((r.scheduled_at_s for r in refused if r.band == band), default=None)
        for band in bands
    }

    def p99(window: tuple[float, float], *bands: str) -> float | None:
        samples = [
            t
            for r in results
            if r.band in bands and _scheduled_in(r, window)
            if (t := ttft_sample(r)) is not None
        ]
        return percentile(samples, 99)

    # At half load nothing is refused and every band is routed alike, so Critical's P99
    # there is estimated from every request of the window: Critical alone has a few dozen,
    # whose P99 is their maximum. Both are reported.
    half = p99(windows.half_load, *bands)
    over = p99(windows.overload, "critical")
    start, end = windows.overload
    return {
        "goodput_tokens_per_s": sum(_tokens_in(r, windows.overload) for r in results)
        / (end - start),
        "ttft_p99_half_load_s": half,
        "critical_ttft_p99_half_load_s": p99(windows.half_load, "critical"),
        "critical_ttft_p99_overload_s": over,
        "critical_ttft_p99_ratio": None if not half or over is None else over / half,
        "first_refusal_s_by_band": first_refusal,
        "refused_fraction_by_band": {
            band: sum(1 for r in refused if r.band == band)
            / max(1, sum(1 for r in results if r.band == band))
            for band in bands
        },
        "server_errors": sum(1 for r in results if r.status is not None and r.status >= 500),
        "windows": {"half_load": list(windows.half_load), "overload": list(windows.overload)},
    }


async def fleet_capacity_tokens_per_s(
    pods: Sequence[PodSpec],
    *,
    model: str,
    shapes: Sequence[tuple[int, int]],
    warmup_s: float = 15.0,
    window_s: float = 10.0,
) -> dict[str, Any]:
    """The fleet's output-token capacity for requests of `shapes` ((prompt, output) tokens,
    taken in turn: the scenario's own mix): one saturation probe per distinct profile, on
    a pod of its own, times the pods of that profile. The warm-up is long because a
    closed loop starts with every request fresh: until the long requests have piled up
    as they do in steady state, steps are cheaper and throughput looks higher."""
    per_profile: dict[str, float] = {}
    for spec in pods:
        if spec.profile.name in per_profile:
            continue
        async with Fleet((spec,), model=model) as fleet:
            (pod,) = fleet.pods
            probe = await saturation_probe(
                f"http://127.0.0.1:{pod.port}/v1/chat/completions",
                model=model,
                prompt_tokens=shapes[0][0],
                output_tokens=shapes[0][1],
                shapes=shapes,
                concurrency=spec.profile.max_num_seqs + 16,
                warmup_s=warmup_s,
                window_s=window_s,
                ramp_s=2.0,
            )
        per_profile[spec.profile.name] = probe.output_tokens_per_s
    counts: Mapping[str, int] = {
        name: sum(1 for p in pods if p.profile.name == name) for name in per_profile
    }
    return {
        "capacity_tokens_per_s": sum(per_profile[n] * counts[n] for n in per_profile),
        "probe_tokens_per_s_by_profile": per_profile,
    }
