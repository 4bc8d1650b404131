"""Scenario shapes keep the property their figures depend on (pure: no sockets)."""

from __future__ import annotations

from bench.scenarios import build_scenario
from llm_sim.loadgen.trace import generate_trace


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


def test_shared_prefixes_fit_every_pod_in_c_and_only_a_share_of_them_in_c96() -> None:
    for name, fits_one_pod in (("c", True), ("c96", False)):
        scenario = build_scenario(name, duration_s=16)
        groups = scenario.trace.prefix_groups
        assert groups is not None and scenario.session_affinity
        prefixes = groups.groups * groups.prefix_words
        kv_tokens = scenario.pods[0].profile.max_model_len
        # In c a warm pod holds every prefix whoever routes; in c96 it cannot, but a
        # quarter of them (one pod's share under consistent hashing) fits in 61% of it.
        assert (prefixes < 0.85 * kv_tokens) is fits_one_pod, (name, prefixes, kv_tokens)
        assert prefixes / len(scenario.pods) < 0.65 * kv_tokens
