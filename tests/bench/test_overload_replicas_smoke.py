"""Scenario f2 in a seconds-long run: f's overload through two real Envoys, each attached to
its own server replica (separate processes that share their Envoys' load), the requests
split 70/30; the fleet-wide budgets hold whichever Envoy admits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main


@pytest.mark.slow
def test_quick_overload_on_two_replicas_stays_within_the_pool_limit(tmp_path: Path) -> None:
    argv = ["run", "--scenarios", "f2", "--policies", "project", "--quick", "--out", str(tmp_path)]
    assert main(argv) == 0
    project = json.loads((tmp_path / "results.json").read_text())["scenarios"]["f2"]["policies"][
        "project"
    ]
    assert project["envoys"] == 2 and project["replicas"] == ["a", "b"]
    by_envoy = project["split"]["by_envoy"]
    counts = [by_envoy[node]["requests"] for node in ("bench-envoy-a", "bench-envoy-b")]
    assert 0.6 < counts[0] / sum(counts) < 0.8, counts
    # Every Envoy refuses, by band, never Critical, always with a Retry-After; no 5xx.
    assert all(by_envoy[node]["status_counts"].get("429", 0) > 0 for node in by_envoy)
    assert project["refused_by_band"]["critical"] == 0
    assert project["retry_after_missing"] == 0
    assert project["server_errors"] == 0
    assert set(project["status_counts"]) <= {"200", "429"}
    # Sampled every 100 ms all along the run: at most one place over per Envoy.
    assert project["admitted_samples"] > 50
    assert project["max_admitted_over_limit"] <= 2
    assert (tmp_path / "traces" / "f2-seed1-admitted.jsonl").exists()


def test_f2_runs_only_the_project_policy(tmp_path: Path) -> None:
    argv = ["run", "--scenarios", "f2", "--policies", "round_robin", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert not (tmp_path / "results.json").exists()
