"""A seconds-long run of one peer policy (`vllm-router --policy cache_aware`) on scenario a."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.peers import PEER_POLICIES
from bench.runner import ALL_POLICIES, policies_of
from bench.scenarios import build_scenario

try:
    ROUTER_VERSION = importlib.metadata.version("vllm-router")
except importlib.metadata.PackageNotFoundError:
    ROUTER_VERSION = None


def test_peer_policies_are_offered_where_the_trace_goes_to_one_url() -> None:
    assert set(PEER_POLICIES) <= set(ALL_POLICIES)
    runs, skipped = policies_of(build_scenario("a", duration_s=1.0), list(ALL_POLICIES))
    assert set(PEER_POLICIES) <= set(runs) and not skipped
    # g measures its faults in Envoy: no peer there.
    runs, skipped = policies_of(build_scenario("g", duration_s=1.0), ["vllm_router_cache_aware"])
    assert (runs, skipped) == ([], ["vllm_router_cache_aware"])


@pytest.mark.skipif(ROUTER_VERSION is None, reason="vllm-router is not installed (bench extra)")
def test_vllm_router_cache_aware_serves_the_trace(tmp_path: Path) -> None:
    policy = "vllm_router_cache_aware"
    argv = ["run", "--scenarios", "a", "--quick", "--policies", policy, "--out", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["peer_versions"] == {"vllm-router": ROUTER_VERSION}
    summary = results["scenarios"]["a"]["policies"][policy]
    assert summary["requests"] > 0
    # A quick run cuts off what is still running at its end, as for every policy.
    assert summary["status_counts"].get("200", 0) > 0.5 * summary["requests"], summary
    assert summary["ttft_p95_s"] is not None and summary["ttft_p95_s"] > 0
    assert "--policy cache_aware" in summary["peer"]["command"]
    assert "--worker-urls http://127.0.0.1:" in summary["peer"]["command"]
