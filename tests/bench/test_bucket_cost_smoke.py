"""bench.bucket_cost on small pools: every case decides and reports its time."""

from __future__ import annotations

from bench.bucket_cost import bucket_cost


def test_both_cases_report_a_decision_time() -> None:
    for churn in (False, True):
        result = bucket_cost(pods=40, buckets=64, decisions=4, churn=churn)
        assert result["spares_change"] is churn
        assert 0 < result["decision_ms_median"] <= result["decision_ms_max"]
