"""Scenario shapes keep the property their figures depend on (pure: no sockets)."""

from __future__ import annotations

from bench.scenarios import build_scenario
from xds_server.sim.loadgen.trace import generate_trace


def test_bursty_documents_block_pods_yet_stay_under_one_percent_of_requests() -> None:
    scenario = build_scenario("b", duration_s=16)
    trace = generate_trace(scenario.trace, seed=1)
    documents = [r for r in trace.requests if r.request_class == "document"]
    profile = scenario.pods[0].profile
    # P99 measures the chats behind documents only if documents are under 1% of requests,
    # and there must be a few of them to block anyone.
    assert 3 <= len(documents) < 0.01 * len(trace.requests), len(documents)
    # Each holds its pod's whole token budget for over a second: a chat behind one waits.
    assert all(r.prompt_words > profile.max_batched_tokens for r in documents)
    assert min(r.prompt_words for r in documents) / profile.prefill_tokens_per_s > 1.5
    assert {p.profile for p in scenario.pods} == {profile}
