"""bench.verdict_cost at a small size: the figures it reports are there and sane."""

from __future__ import annotations

from bench.verdict_cost import verdict_cost


def test_verdict_cost_reports_positive_costs() -> None:
    result = verdict_cost(pools=3, pods=5, ticks=3, envoys=3)
    assert result["endpoints"] == 15
    assert result["cpu_ms_per_report"] > 0
    assert result["cpu_ms_per_evaluation"] > 0
    assert result["cpu_ms_views"] >= 0
