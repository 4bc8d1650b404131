"""Figures over seeds that a median over seeds hides (issue 35: a benchmark that cannot be
tuned to).

The per-scenario figures of results.json are medians over seeds (bench/runner.py
`_merge_seeds`): with three seeds, the P99 reported is the middle seed's, and one seed's
bad tail is invisible. Here every seed's requests are pooled before the percentile is
taken, and each seed's own P95 and P99 are kept as min / median / max: the spread that
says whether two policies are level. Percentiles are nearest rank, as in
llm_sim.loadgen.stats, so one seed's pooled figures are that seed's own.

`served_shares` compares where the requests went with where the capacity is: each pod's
share of the requests served against its share of the fleet's nominal capacity, and the
largest deviation `|share / capacity share - 1|` over pods (issue 35's acceptance for c and
its variants: within 25%).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from llm_sim.loadgen.stats import percentile

__all__ = ["LATENCIES", "pooled_latencies", "pooled_tails", "served_shares"]

# The per-request latencies pooled (the report's TTFT, TPOT and end-to-end columns).
LATENCIES = ("ttft", "tpot", "e2e")


def pooled_tails(per_seed: Sequence[Sequence[float]]) -> dict[str, Any]:
    """P50/P95/P99 of every seed's samples pooled (`p50_s`, `p95_s`, `p99_s`; None without
    samples), and each seed's own P95 and P99 as `{"min", "median", "max"}` over the seeds
    that have samples (`p95_seeds_s`, `p99_seeds_s`; None when none has), with the number of
    `samples` and `seeds`."""
    pooled = [t for seed in per_seed for t in seed]
    figures: dict[str, Any] = {f"p{p}_s": percentile(pooled, p) for p in (50, 95, 99)}
    for p in (95, 99):
        values = [v for seed in per_seed if (v := percentile(seed, p)) is not None]
        figures[f"p{p}_seeds_s"] = (
            {"min": min(values), "median": statistics.median(values), "max": max(values)}
            if values
            else None
        )
    figures["samples"] = len(pooled)
    figures["seeds"] = len(per_seed)
    return figures


def pooled_latencies(per_seed: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, Any]:
    """`pooled_tails` of each of `LATENCIES` (`{"ttft": [...], ...}` per seed, in seconds)."""
    return {kind: pooled_tails([seed.get(kind, ()) for seed in per_seed]) for kind in LATENCIES}


def served_shares(served_by: Mapping[str, int], capacity: Mapping[str, float]) -> dict[str, Any]:
    """Each pod of `capacity` (its nominal requests/s, any unit): how many requests it
    served (`served_by`, summed over seeds), its `share` of the requests the pods of
    `capacity` served, its `capacity_share`, and their `ratio`; `max_deviation` is the
    largest `|ratio - 1|`. Requests that name no pod of `capacity` count in no share.
    With no request served, every share and `max_deviation` is None."""
    served = {pod: int(served_by.get(pod, 0)) for pod in capacity}
    total, fleet = sum(served.values()), sum(capacity.values())
    pods: dict[str, dict[str, Any]] = {}
    for pod, requests in served.items():
        capacity_share = capacity[pod] / fleet
        share = requests / total if total else None
        pods[pod] = {
            "requests": requests,
            "share": share,
            "capacity_share": capacity_share,
            "ratio": None if share is None else share / capacity_share,
        }
    ratios = [p["ratio"] for p in pods.values() if p["ratio"] is not None]
    return {
        "pods": pods,
        "requests": total,
        "max_deviation": max((abs(r - 1) for r in ratios), default=None),
    }
