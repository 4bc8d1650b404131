"""Scenario g2's schedule and figures (bench/gray.py), on synthetic replay results."""

from __future__ import annotations

from bench.gray import LIAR_SETTLE_S, gray_figures
from bench.scenarios import build_scenario
from llm_sim.loadgen import ReplayResult
from llm_sim.loadgen.results import ErrorKind, RequestResult


def _result(requests: list[RequestResult]) -> ReplayResult:
    return ReplayResult(
        url="http://127.0.0.1:1",
        trace_seed=1,
        started_at_unix=0.0,
        time_scale=1.0,
        max_in_flight=10,
        duration_s=60.0,
        results=tuple(requests),
        loop_lag_p50_s=0.0,
        loop_lag_p99_s=0.0,
        loop_lag_max_s=0.0,
        send_lateness_p99_s=0.0,
        saturated=False,
        cpu_s=0.0,
    )


def _request(
    index: int, at: float, pod: str | None, status: int | None = 200, error: ErrorKind | None = None
) -> RequestResult:
    return RequestResult(
        index=index,
        band="standard",
        model="m",
        scheduled_at_s=at,
        lateness_s=0.0,
        status=status,
        error=error,
        backend_id=pod,
    )


def test_g2_is_ds_fleet_with_its_faults_in_turn() -> None:
    scenario = build_scenario("g2", duration_s=60.0)
    d = build_scenario("d", duration_s=60.0)
    assert scenario.pods == d.pods and scenario.trace.rate_per_s == d.trace.rate_per_s
    gray = scenario.gray
    assert gray is not None and scenario.faults is None
    assert gray.wedge_s < gray.unwedge_s <= gray.reset_s < gray.reset_end_s <= gray.liar_s
    assert len({gray.wedge_pod, gray.reset_pod, gray.liar}) == 3


def test_gray_figures_count_hung_failed_cut_and_the_liars_share() -> None:
    gray = build_scenario("g2", duration_s=60.0).gray
    assert gray is not None
    liar_from = gray.liar_s + LIAR_SETTLE_S
    requests = [
        _request(0, 1.0, "h100-3"),
        # Cut mid-stream by the wedge, on the wedged pod: not a failure of the gateway.
        _request(1, gray.wedge_s + 1, gray.wedge_pod, error=ErrorKind.RESET),
        # Cut elsewhere: a failure.
        _request(2, gray.wedge_s + 1, "h100-3", error=ErrorKind.INCOMPLETE),
        _request(3, gray.reset_s + 1, None, status=503),
        _request(4, gray.reset_s + 2, None, status=None, error=ErrorKind.TIMEOUT),
        _request(5, liar_from + 1, gray.liar),
        _request(6, liar_from + 2, "h100-3"),
        _request(7, liar_from + 3, "h100-0"),
        _request(8, liar_from + 4, "h100-1"),
        # Before the liar settled: not counted in its share.
        _request(9, gray.liar_s + 1, gray.liar),
    ]
    figures = gray_figures(_result(requests), gray, ["a", "b", "c", "d"], {"x": 1})
    assert figures["x"] == 1
    assert figures["hung_requests"] == 1
    assert figures["cut_by_wedge"] == 1
    assert figures["failed_requests"] == 2
    assert figures["liar_share"] == 0.25 and figures["liar_requests_counted"] == 4
    assert figures["fair_share"] == 0.25
