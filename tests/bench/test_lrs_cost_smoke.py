"""bench.lrs_cost at a small size: the figures it reports are there and sane."""

from __future__ import annotations

import pytest

from bench.lrs_cost import lrs_cost


def test_lrs_cost_reports_a_positive_cost_and_rate() -> None:
    result = lrs_cost(pools=5, reports=20)
    assert result["clusters_per_report"] == 20
    assert result["cpu_ms_per_report"] > 0
    assert result["envoys_per_core"] == pytest.approx(0.25 / (result["cpu_ms_per_report"] / 1e3))
