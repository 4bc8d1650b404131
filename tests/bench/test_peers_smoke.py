"""A seconds-long run of one peer policy (`vllm-router --policy cache_aware`) on scenario a,
and what vllm-router's cache_aware gets from a simulated vLLM pod."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import re
from pathlib import Path

import aiohttp
import pytest

from bench.__main__ import main
from bench.peers import PEER_POLICIES, run_vllm_router
from bench.runner import ALL_POLICIES, policies_of
from bench.scenarios import build_scenario
from llm_sim.metrics_text import Flavour
from llm_sim.pod import BACKEND_ID_HEADER, SimulatedPod
from llm_sim.profiles import H100

FAST = H100.scaled(0.1)

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


@pytest.mark.slow
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


async def _backends_through_router(flavour: Flavour, log_path: Path) -> list[str]:
    """Six chats sharing a 64-word prefix, one after another, through `cache_aware` in
    front of two pods of `flavour`: the pod that served each."""
    prefix = " ".join(f"shared{i}" for i in range(64))
    async with contextlib.AsyncExitStack() as stack:
        pods = [
            await stack.enter_async_context(SimulatedPod(f"pod-{i}", profile=FAST, flavour=flavour))
            for i in range(2)
        ]
        peer = await stack.enter_async_context(
            run_vllm_router(
                "cache_aware", workers=[p.url for p in pods], log_path=log_path, log_level="debug"
            )
        )
        http = await stack.enter_async_context(aiohttp.ClientSession())
        backends = []
        for turn in range(6):
            body = {"messages": [{"role": "user", "content": f"{prefix} q{turn}"}], "max_tokens": 2}
            async with http.post(f"{peer.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                backends.append(response.headers[BACKEND_ID_HEADER])
    return backends


@pytest.mark.skipif(ROUTER_VERSION is None, reason="vllm-router is not installed (bench extra)")
async def test_cache_aware_routes_on_the_token_ids_a_vllm_pod_renders(tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    backends = await _backends_through_router(Flavour.VLLM, log)
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # no colours
    # Without the render endpoint (404) the router logs "render_unavailable" per worker and
    # request and makes no prefix decision at all.
    assert "render_unavailable" not in text
    # Later chats match 64 of their 65 rendered token ids in the router's prefix tree.
    assert f"match_rate={64 / 65}" in text, text[-2000:]
    assert len(set(backends)) == 1, backends
