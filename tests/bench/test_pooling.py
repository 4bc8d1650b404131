"""Tails pooled over seeds and served shares, from known inputs (pure: no runs)."""

from __future__ import annotations

import argparse

import pytest

from bench.__main__ import _seed_list
from bench.pooling import pooled_latencies, pooled_tails, served_shares
from bench.report import markdown_table


def test_pooled_tails_take_every_seeds_requests_together_and_keep_each_seeds_spread() -> None:
    # Seed 1: 1..100 ms; seed 2: 101..200 ms; seed 3: 20 samples of 1 s.
    seeds = [
        [i / 1000 for i in range(1, 101)],
        [i / 1000 for i in range(101, 201)],
        [1.0] * 20,
    ]
    figures = pooled_tails(seeds)
    # 220 samples, nearest rank: P50 is the 110th (0.110), P95 the 209th (a 1 s sample,
    # 200 below it), P99 the 218th.
    assert figures["samples"] == 220 and figures["seeds"] == 3
    assert figures["p50_s"] == pytest.approx(0.110)
    assert figures["p95_s"] == figures["p99_s"] == 1.0
    # Each seed's own P95: 0.095, 0.195, 1.0; P99: 0.099, 0.199, 1.0.
    assert figures["p95_seeds_s"] == pytest.approx({"min": 0.095, "median": 0.195, "max": 1.0})
    assert figures["p99_seeds_s"] == pytest.approx({"min": 0.099, "median": 0.199, "max": 1.0})


def test_one_seed_pools_to_its_own_figures_and_no_samples_to_none() -> None:
    one = pooled_tails([[0.3, 0.1, 0.2]])
    assert (one["p50_s"], one["p99_s"]) == (0.2, 0.3)
    assert one["p99_seeds_s"] == {"min": 0.3, "median": 0.3, "max": 0.3}
    empty = pooled_tails([[], []])
    assert empty["p99_s"] is None and empty["p95_seeds_s"] is None and empty["seeds"] == 2
    # A seed without samples is left out of the spread, not counted as zero.
    assert pooled_tails([[], [0.5]])["p95_seeds_s"] == {"min": 0.5, "median": 0.5, "max": 0.5}
    both = pooled_latencies([{"ttft": [0.1], "e2e": [2.0]}, {"ttft": [0.3]}])
    assert set(both) == {"ttft", "tpot", "e2e"}
    assert both["ttft"]["p99_s"] == 0.3 and both["tpot"]["p50_s"] is None
    assert both["e2e"]["samples"] == 1


def test_served_shares_hold_each_pod_against_its_capacity_share() -> None:
    # Two fast pods (3 each) and two slow (1 each): capacity shares 37.5% and 12.5%.
    capacity = {"fast-0": 3.0, "fast-1": 3.0, "slow-0": 1.0, "slow-1": 1.0}
    served = {"fast-0": 300, "fast-1": 400, "slow-0": 200, "slow-1": 100, "none": 7}
    figures = served_shares(served, capacity)
    assert figures["requests"] == 1000
    assert figures["pods"]["fast-1"] == pytest.approx(
        {"requests": 400, "share": 0.4, "capacity_share": 0.375, "ratio": 0.4 / 0.375}
    )
    # slow-0: 20% of the requests for 12.5% of the capacity, 1.6x: the largest deviation.
    assert figures["max_deviation"] == pytest.approx(0.6)
    idle = served_shares({}, capacity)
    assert idle["max_deviation"] is None and idle["pods"]["slow-0"]["share"] is None


def test_results_md_gives_pooled_tails_with_their_spread_and_served_shares() -> None:
    pooled = {
        "ttft": pooled_tails([[0.1] * 98 + [0.153] * 2, [0.1] * 98 + [0.221] * 2]),
        "tpot": pooled_tails([[0.02], [0.03]]),
        "e2e": pooled_tails([[1.0], [2.0]]),
    }
    results = {
        "seeds": 2,
        "seed_list": [4, 5],
        "scenarios": {
            "c@more-prefixes": {
                "title": "t",
                "pods": [
                    {"name": "h100-0", "profile": "H100", "capacity_requests_per_s": 4.0},
                    {"name": "h100-1", "profile": "H100", "capacity_requests_per_s": 4.0},
                ],
                "policies": {
                    "project": {"pooled": pooled, "served_by": {"h100-0": 60, "h100-1": 40}},
                    "round_robin": {"served_by": {"h100-0": 50, "h100-1": 50}},
                },
            }
        },
    }
    table = markdown_table(results)
    assert "Pooled over seeds 4, 5:" in table
    # Pooled P99 of 200 samples: the 198th, 0.153 s (four slow ones, two at 0.221 s); the
    # seeds' own P99s are 153 and 221 ms. P50 has no spread beside it.
    assert (
        "| project | 100 | 100 (seeds 100–100–100) | 153 (seeds 153–187–221) | 20"
        " | 2,000 (seeds 1,000–1,500–2,000) |"
    ) in table
    assert "| policy | h100-0 (50%) | h100-1 (50%) | largest deviation |" in table
    assert "| round_robin | 50.0% | 50.0% | 0% |" in table
    assert "| project | 60.0% | 40.0% | 20% |" in table


def test_seed_lists_are_distinct_non_negative_integers() -> None:
    assert _seed_list("4,5,6,7,8") == [4, 5, 6, 7, 8]
    for bad in ("4,4", "a", "", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="seeds"):
            _seed_list(bad)
