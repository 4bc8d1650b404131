"""Scenario i's figures (bench/failover.py) from outcomes written out by hand: the
failover time, the failures, the TTFT in the failover window and the ramp back."""

from __future__ import annotations

from bench.failover import Outcome, Timeline, figures

TIMELINE = Timeline(duration_s=14.0, kill_s=4.0, revive_s=8.0)


def _ok(sent_s: float, pod: str, ttft_s: float = 0.05) -> Outcome:
    return Outcome(sent_s=sent_s, pod=pod, status=200, whole=True, ttft_s=ttft_s)


def test_figures_of_a_failover_and_its_ramp() -> None:
    outcomes = [_ok(t / 2, "a-0") for t in range(0, 8)]  # 0 .. 3.5 s: all on A
    outcomes.append(Outcome(sent_s=3.9, pod="a-1", status=200))  # cut at the kill
    outcomes.append(Outcome(sent_s=4.1, status=503))  # before the failover
    outcomes += [_ok(4.5 + t / 2, "b-0", ttft_s=0.1 * (t + 1)) for t in range(7)]
    outcomes += [_ok(8.2, "b-1"), _ok(8.7, "b-0")]  # second 0 after the revival: no A
    outcomes += [_ok(9.2, "a-0"), _ok(9.7, "b-0")]  # second 1: half
    outcomes += [_ok(10.2, "a-0"), _ok(10.7, "a-1")]  # second 2: all A again
    result = figures(outcomes, [(8.5, 3), (3.0, 9), (12.0, 5)], TIMELINE)
    assert result["failed_requests"] == 2
    assert result["failed_before_headers"] == 1
    assert result["failover_s"] == 0.5  # from 4.5 s on, everything succeeded
    assert result["failover_window_requests"] == 8
    assert result["ttft_p99_s"] == 0.7
    assert result["a_share_before"] == 1.0
    assert result["a_share_per_second"][:3] == [0.0, 0.5, 1.0]
    assert result["ramp_up_s"] == 3.0
    # Only the ramp's peaks count (8 s to 11 s), and the steady state's apart.
    assert result["ramp_max_pod_requests"] == 3
    assert result["steady_max_pod_requests"] == 9


def test_a_cluster_without_failover_never_recovers_its_window() -> None:
    outcomes = [_ok(1.0, "a-0"), Outcome(sent_s=5.0, status=503), Outcome(sent_s=7.0, status=503)]
    result = figures(outcomes, [], TIMELINE)
    assert result["failover_s"] is None and result["ttft_p99_s"] is None
    assert result["failover_window_failed"] == 2
