"""A seconds-long run of the routing benchmark through a real Envoy (scenario a, quick)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.runner import POLICIES
from llm_sim.loadgen import ReplayResult

pytestmark = pytest.mark.slow  # A benchmark run end to end: the slow tier


def test_quick_benchmark_runs_every_policy_and_tells_them_apart(tmp_path: Path) -> None:
    assert main(["run", "--scenarios", "a", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) >= {"scenarios", "machine_saturated"}
    policies = results["scenarios"]["a"]["policies"]
    assert set(policies) == set(POLICIES)
    requests = {p: s["requests"] for p, s in policies.items()}
    assert len(set(requests.values())) == 1, requests  # the same trace for every policy
    for name, summary in policies.items():
        assert summary["status_counts"].get("200", 0) > 0.5 * summary["requests"], (name, summary)
        for key in (
            "ttft_p50_s",
            "ttft_p95_s",
            "ttft_p99_s",
            "tpot_p50_s",
            "e2e_p99_s",
            "output_tokens_per_s",
        ):
            assert summary[key] is not None and summary[key] > 0, (name, key)

    def slow_share(policy: str) -> float:
        served = policies[policy]["served_by"]
        return sum(v for k, v in served.items() if k.startswith("a10g")) / sum(served.values())

    # Round robin gives the slow half of the fleet half of the requests; least request
    # notices their queues and sends them less; the oracle knows they are slow.
    assert 0.4 < slow_share("round_robin") < 0.6
    assert slow_share("least_request") < slow_share("round_robin") - 0.05
    assert policies["oracle"]["ttft_p99_s"] < policies["round_robin"]["ttft_p99_s"]

    assert "| round_robin |" in (tmp_path / "results.md").read_text()
    # Every request's pod and times, per policy, beside the trace.
    for name in POLICIES:
        saved = ReplayResult.load(tmp_path / "traces" / f"a-seed1-{name}-results.json")
        assert len(saved.results) == requests[name], name
    assert (tmp_path / "ttft_cdf_a.png").stat().st_size > 10_000
