"""The report's tables from small synthetic results (pure: no runs)."""

from __future__ import annotations

from typing import Any

from bench.report import best_peer, headline_table, markdown_table, ttft_counts


def _summary(p95: list[float], p99: list[float], *, tokens: float = 500.0) -> dict[str, Any]:
    """A policy merged over seeds as bench/runner.py writes it: medians and `per_seed`."""
    statuses = [{"200": 100}, {"200": 98, "429": 2}, {"200": 99, "error:timeout": 1}]
    return {
        "ttft_p95_s": sorted(p95)[1],
        "ttft_p99_s": sorted(p99)[1],
        "output_tokens_per_s": tokens,
        "requests": 100,
        "status_counts": {"200": 297, "429": 2, "error:timeout": 1},
        "per_seed": {
            "ttft_p95_s": p95,
            "ttft_p99_s": p99,
            "output_tokens_per_s": [tokens] * 3,
            "requests": [100, 100, 100],
            "status_counts": statuses,
        },
    }


def _results(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"seeds": 3, "scenarios": {"a": {"title": "t", "policies": policies}}}


FULL = {
    "round_robin": _summary([0.9, 1.0, 1.1], [1.9, 2.0, 2.1]),
    "project": _summary([0.2, 0.3, 0.4], [0.5, 0.8, 0.9], tokens=520.0),
    "oracle": _summary([0.1, 0.2, 0.3], [0.3, 0.4, 0.5]),
    "vllm_router_power_of_two": _summary([0.7, 0.8, 0.9], [1.1, 1.2, 1.3]),
    # Same P99 as power_of_two, lower P95: wins the tie.
    "vllm_router_cache_aware": _summary([0.5, 0.6, 0.7], [1.0, 1.2, 1.4]),
    "vllm_router_consistent_hash": _summary([0.1, 0.1, 0.1], [1.5, 1.6, 1.7]),
}


def test_best_peer_is_lowest_p99_with_ties_broken_by_p95() -> None:
    assert best_peer(FULL) == "vllm_router_cache_aware"
    assert best_peer({"project": FULL["project"]}) is None


def test_ttft_counts_leave_out_refusals_but_keep_timeouts() -> None:
    assert ttft_counts(FULL["project"]) == [100, 98, 100]
    assert ttft_counts({"requests": 7, "status_counts": {"200": 6, "error:connect": 1}}) == [6]


def test_headline_rows_hold_median_spread_closure_and_count() -> None:
    table = headline_table(_results(FULL))
    rows = [line for line in table.splitlines() if line.startswith("| a |")]
    # Gap closure on P99: (2.0 - 0.8) / (2.0 - 0.4) = 75%, (2.0 - 1.2) / 1.6 = 50%.
    assert rows == [
        "| a | project | 300 (200–400) | 800 (500–900) | 520 (520–520) | 75% "
        "| 98–100 (P99: #1–2 slowest) |",
        "| a | best peer: vllm_router_cache_aware | 600 (500–700) | 1,200 (1,000–1,400) "
        "| 500 (500–500) | 50% | 98–100 (P99: #1–2 slowest) |",
    ]
    assert "ties by P95" in table
    assert "median over 3 seeds" in table


def test_headline_says_so_without_peers_or_oracle() -> None:
    no_peers = {p: s for p, s in FULL.items() if not p.startswith("vllm_router_")}
    assert "no project-vs-best-peer table" in headline_table(_results(no_peers))
    no_oracle = {p: s for p, s in FULL.items() if p != "oracle"}
    table = headline_table(_results(no_oracle))
    assert "No oracle in this run: no gap closure." in table
    assert "| a | project | 300 (200–400) | 800 (500–900) | 520 (520–520) | – |" in table


def test_scenario_tables_list_every_policy_peers_after_the_others() -> None:
    table = markdown_table(_results(FULL))
    assert table.startswith("### Project vs best peer")
    scenario = table[table.index("### Scenario a") :]
    names = [line.split(" | ")[0][2:] for line in scenario.splitlines() if line.startswith("| ")]
    assert names[1:7] == [
        "round_robin",
        "project",
        "oracle",
        "vllm_router_cache_aware",
        "vllm_router_consistent_hash",
        "vllm_router_power_of_two",
    ]


def test_one_seed_has_no_spread_and_scenarios_without_peers_are_named() -> None:
    one = {"requests": 50, "status_counts": {"200": 50}, "output_tokens_per_s": 10.0}
    results = {
        "seeds": 1,
        "scenarios": {
            "a": {
                "policies": {
                    "project": {**one, "ttft_p95_s": 0.1, "ttft_p99_s": 0.2},
                    "vllm_router_power_of_two": {**one, "ttft_p95_s": 0.3, "ttft_p99_s": 0.4},
                }
            },
            "g": {"policies": {"project": {**one, "ttft_p95_s": 0.1, "ttft_p99_s": 0.2}}},
        },
    }
    table = headline_table(results)
    assert "One seed: no spread." in table
    assert "| a | project | 100 | 200 | 10 | – | 50 (P99: #1 slowest) |" in table
    assert "Not in this table (no project or no peer run): g." in table
