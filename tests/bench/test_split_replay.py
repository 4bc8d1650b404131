"""Scenario f2's split of one trace over several Envoys (pure: no sockets)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.scenarios import build_scenario
from bench.split_replay import merge_results, part_of_each_request, split_trace
from llm_sim.loadgen import ReplayResult, RequestResult
from llm_sim.loadgen.trace import generate_trace


def test_a_trace_splits_70_30_the_same_way_every_time_keeping_indices_and_offsets() -> None:
    trace = generate_trace(build_scenario("f2", duration_s=16).trace, seed=1)
    parts = split_trace(trace, shares=(0.7, 0.3))
    assert part_of_each_request(trace, shares=(0.7, 0.3)) == part_of_each_request(
        trace, shares=(0.7, 0.3)
    )
    assert sorted(r.index for p in parts for r in p.requests) == list(range(len(trace.requests)))
    assert 0.65 < len(parts[0].requests) / len(trace.requests) < 0.75
    # Each band is split in about the same shares.
    for band in ("critical", "standard", "sheddable"):
        mine = [len([r for r in p.requests if r.band == band]) for p in parts]
        assert 0.6 < mine[0] / sum(mine) < 0.8, (band, mine)
    by_index = {r.index: r for r in trace.requests}
    assert all(r == by_index[r.index] for p in parts for r in p.requests)
    # Another seed, another split.
    other = dataclasses.replace(trace, seed=2)
    assert part_of_each_request(other, shares=(0.7, 0.3)) != part_of_each_request(
        trace, shares=(0.7, 0.3)
    )


def test_shares_must_sum_to_one() -> None:
    trace = generate_trace(build_scenario("f2", duration_s=4).trace, seed=1)
    with pytest.raises(ValueError, match="sum to 1"):
        split_trace(trace, shares=(0.7, 0.2))


def _result(url: str, indices: list[int], *, started: float, lag: float) -> ReplayResult:
    return ReplayResult(
        url=url,
        trace_seed=1,
        started_at_unix=started,
        time_scale=1.0,
        max_in_flight=10,
        duration_s=5.0,
        results=tuple(
            RequestResult(
                index=i, band="standard", model="m", scheduled_at_s=i, lateness_s=0, status=200
            )
            for i in indices
        ),
        loop_lag_p50_s=lag,
        loop_lag_p99_s=lag,
        loop_lag_max_s=lag,
        send_lateness_p99_s=lag,
        saturated=lag > 0.05,
        cpu_s=1.0,
    )


def test_merged_results_are_in_trace_order_with_the_worst_health() -> None:
    a = _result("http://a", [0, 2, 3], started=10.0, lag=0.001)
    b = _result("http://b", [1, 4], started=10.0005, lag=0.06)
    merged = merge_results([a, b], url="http://a http://b")
    assert [r.index for r in merged.results] == [0, 1, 2, 3, 4]
    assert merged.started_at_unix == 10.0
    assert merged.saturated and merged.loop_lag_p99_s == 0.06
    assert merged.metadata["urls"] == ["http://a", "http://b"]
