"""Percentiles and the run summary, on hand-made results."""

from __future__ import annotations

import json

import pytest

from llm_sim.loadgen import ErrorKind, RequestResult, percentile, summarize


def result(
    index: int,
    *,
    band: str = "standard",
    status: int | None = 200,
    error: ErrorKind | None = None,
    ttft: float | None = None,
    tokens: int = 0,
    retry_after: str | None = None,
) -> RequestResult:
    e2e = None if ttft is None else ttft + 0.01 * max(tokens - 1, 0)
    if error is ErrorKind.TIMEOUT and ttft is None:
        e2e = 30.0  # waited until the timeout without a token
    return RequestResult(
        index=index,
        band=band,
        model="m",
        scheduled_at_s=index * 0.1,
        lateness_s=0.0,
        status=status,
        error=error,
        ttft_s=ttft,
        tpot_s=0.01 if tokens > 1 and ttft is not None else None,
        e2e_s=e2e,
        output_tokens=tokens,
        retry_after=retry_after,
    )


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in (7, 1, 10, 3, 5, 2, 9, 4, 8, 6)]
    assert percentile(values, 50) == 5
    assert percentile(values, 90) == 9
    assert percentile(values, 95) == 10
    assert percentile(values, 99) == 10
    assert percentile(values, 100) == 10
    assert percentile(values, 10) == 1
    assert percentile(values, 1) == 1
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="outside"):
        percentile(values, 0)


def test_summary_of_a_mixed_run() -> None:
    results = [
        *(result(i, ttft=0.1 * (i + 1), tokens=10) for i in range(10)),  # ttft 0.1 .. 1.0
        result(10, band="critical", ttft=0.05, tokens=4),
        result(11, band="sheddable", status=429, retry_after="1"),
        result(12, band="sheddable", status=429),
        result(13, band="sheddable", status=503),
        result(14, status=None, error=ErrorKind.TIMEOUT),
        result(15, status=200, error=ErrorKind.RESET, ttft=0.01, tokens=3),
        result(16, status=None, error=ErrorKind.DROPPED_BY_CLIENT),
    ]
    summary = summarize(results, duration_s=2.0)
    assert summary.requests == 17
    assert summary.successful == 11
    assert summary.status_counts == {
        "200": 11,
        "429": 2,
        "503": 1,
        "error:dropped_by_client": 1,
        "error:reset": 1,
        "error:timeout": 1,
    }
    # Every request not refused: 0.01 (reset after its first token), 0.05, 0.1, ..., 1.0, and
    # the timeout counted with the 30 s it waited (13 values). Refusals and the request never
    # sent do not count.
    assert summary.ttft_p50_s == pytest.approx(0.5)
    assert summary.ttft_p95_s == pytest.approx(30.0)
    assert summary.ttft_p99_s == pytest.approx(30.0)
    assert summary.tpot_p50_s == pytest.approx(0.01)
    assert summary.e2e_p50_s == pytest.approx(0.5 + 0.09)
    assert summary.output_tokens_per_s == pytest.approx((10 * 10 + 4) / 2.0)
    assert summary.ttft_p99_by_band_s == {
        "critical": pytest.approx(0.05),
        "sheddable": None,
        "standard": pytest.approx(30.0),
    }
    assert summary.refused_by_band == {"critical": 0, "sheddable": 3, "standard": 0}
    assert summary.retry_after_missing == 1


def test_summary_json_has_the_documented_keys() -> None:
    summary = summarize([result(0, ttft=0.2, tokens=2)], duration_s=1.0)
    document = json.loads(json.dumps(summary.to_json()))
    assert set(document) == {
        "requests",
        "successful",
        "duration_s",
        "status_counts",
        "ttft_p50_s",
        "ttft_p95_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p95_s",
        "e2e_p50_s",
        "e2e_p99_s",
        "output_tokens_per_s",
        "ttft_p99_by_band_s",
        "refused_by_band",
        "retry_after_missing",
        "failed_before_headers",
        "cut_streams",
        "cut_streams_without_tokens",
        "non_json_errors",
    }
    assert document["status_counts"] == {"200": 1}


def test_an_empty_run() -> None:
    summary = summarize([], duration_s=1.0)
    assert summary.requests == 0
    assert summary.ttft_p99_s is None and summary.output_tokens_per_s == 0
    with pytest.raises(ValueError, match="positive"):
        summarize([], duration_s=0)
