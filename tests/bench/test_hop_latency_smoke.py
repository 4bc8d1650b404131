"""A few rounds of `python -m bench hop-latency`: a real Envoy and a real vllm-router in
front of one simulated pod, each path answering with positive, finite latencies."""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.hop_latency import DIRECT, ENVOY

pytestmark = pytest.mark.slow  # A benchmark run end to end: the slow tier

try:
    ROUTER_VERSION = importlib.metadata.version("vllm-router")
except importlib.metadata.PackageNotFoundError:
    ROUTER_VERSION = None

PEER = "vllm_router_cache_aware"


@pytest.mark.skipif(ROUTER_VERSION is None, reason="vllm-router is not installed (bench extra)")
def test_every_path_is_measured_and_the_hops_are_set_against_direct(tmp_path: Path) -> None:
    argv = ["hop-latency", "--requests", "5", "--warmup", "1", "--peers", PEER]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "hop_latency.json").read_text())
    assert results["requests_per_path"] == 5
    assert results["versions"]["vllm-router"] == ROUTER_VERSION
    assert results["versions"]["envoy"]
    assert "--policy cache_aware" in results["peer_commands"][PEER]
    paths = results["paths"]
    assert set(paths) == {DIRECT, ENVOY, PEER}
    for path, figures in paths.items():
        for key in ("first_token_s", "total_s"):
            for value in figures[key].values():
                assert math.isfinite(value) and value > 0, (path, key, figures)
        assert figures["first_token_s"]["p50"] <= figures["total_s"]["p99"]
        added = {"added_first_token_s", "added_total_s"} & set(figures)
        assert len(added) == (0 if path == DIRECT else 2), path
        for key in added:
            assert set(figures[key]) == {"p50", "p99"}
            assert all(math.isfinite(v) for v in figures[key].values()), (path, figures)
    line = (tmp_path / "hop_latency.md").read_text()
    assert line.startswith("One proxy hop at idle (5 sequential") and ENVOY in line and PEER in line
