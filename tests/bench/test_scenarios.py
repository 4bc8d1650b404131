"""Scenario shapes keep the property their figures depend on (pure: no sockets)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bench.__main__ import main
from bench.runner import _routing
from bench.scenarios import HOT_KEYS_HEAVY, VARIANTS, Scenario, build_scenario, scenario_names
from llm_sim.loadgen.spec import PrefixGroups
from llm_sim.loadgen.trace import generate_trace
from llm_sim.profiles import A10G, H100


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


def _flat(scenario: Scenario) -> dict[str, Any]:
    """Every field of a scenario, the trace's leaf by leaf (`trace.prefix_groups.groups`)."""

    def leaves(prefix: str, value: Any) -> dict[str, Any]:
        if isinstance(value, dict):
            return {
                k: v
                for key, item in value.items()
                for k, v in leaves(f"{prefix}.{key}", item).items()
            }
        return {prefix: value}

    fields = {f.name: getattr(scenario, f.name) for f in dataclasses.fields(scenario)}
    trace = fields.pop("trace")
    return {**fields, **leaves("trace", trace.model_dump())}


# What each variant changes in each scenario it applies to: its name, its title, and these.
_CHANGED = {
    ("gpu-mix", "a"): {"pods", "capacity_requests_per_s", "trace.rate_per_s"},
    ("gpu-mix", "d"): {"pods", "capacity_requests_per_s", "trace.rate_per_s"},
    ("more-prefixes", "c"): {
        "capacity_requests_per_s",
        "trace.rate_per_s",
        "trace.prefix_groups.groups",
        "trace.prefix_groups.prefix_words",
    },
    ("flat-adapters", "e"): {"pods", "adapters", "trace.lora.adapters", "trace.lora.zipf_s"},
    ("key-skew", "h"): {"trace.users.heavy"},
    ("burst-shape", "b"): {"trace.bursts"},
    ("burst-shape", "d"): {"trace.bursts"},
}


def test_each_variant_changes_what_it_names_and_nothing_else() -> None:
    assert {(v.name, s) for v in VARIANTS.values() for s in v.scenarios} == set(_CHANGED)
    for (variant, name), changed in _CHANGED.items():
        base = build_scenario(name, duration_s=16)
        varied = build_scenario(f"{name}@{variant}", duration_s=16)
        assert varied.name == f"{name}@{variant}"
        assert varied.title.endswith(
            f"; variant {variant}: {VARIANTS[variant].changes[name].title}"
        )
        before, after = _flat(base), _flat(varied)
        differ = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert differ == changed | {"name", "title"}, (variant, name)
        # Rates stay at the scenario's share of the (new) fleet's capacity.
        share = base.trace.rate_per_s / base.capacity_requests_per_s
        assert varied.trace.rate_per_s / varied.capacity_requests_per_s == pytest.approx(share)


def test_variants_shape_what_their_docstrings_say() -> None:
    a = build_scenario("a@gpu-mix", duration_s=16)
    assert [p.profile.name for p in a.pods].count(H100.name) == 1 and len(a.pods) == 4
    d = build_scenario("d@gpu-mix", duration_s=16)
    assert [p.profile.name for p in d.pods].count(A10G.name) == 1 and len(d.pods) == 4
    c = build_scenario("c@more-prefixes", duration_s=16)
    assert c.trace.prefix_groups == PrefixGroups(groups=64, prefix_words=3072)
    assert c.trace.request_classes == build_scenario("c", duration_s=16).trace.request_classes
    e = build_scenario("e@flat-adapters", duration_s=16)
    assert e.trace.lora is not None and e.trace.lora.zipf_s == 0.6
    assert len(e.adapters) == 16 == len(set(e.adapters)) and e.trace.lora.adapters == e.adapters
    assert all(p.adapters == e.adapters and p.profile.max_loras == 2 for p in e.pods)
    [pool] = _routing(e, "project", [("127.0.0.1", 1)]).pools
    assert tuple(pool.adapters) == e.adapters and pool.adapter_slots == 2
    h = build_scenario("h@key-skew", duration_s=16)
    assert h.trace.users is not None and sum(h.trace.users.heavy) == pytest.approx(1)
    assert max(h.trace.users.heavy) < min(HOT_KEYS_HEAVY[0], 0.5)
    b = build_scenario("b@burst-shape", duration_s=16)
    assert len(b.trace.bursts) == 2 and all(x.multiplier == 1.9 for x in b.trace.bursts)
    trace = generate_trace(build_scenario("d@burst-shape", duration_s=16).trace, seed=1)
    assert len(trace.requests) > len(
        generate_trace(build_scenario("d", duration_s=16).trace, seed=1).requests
    )


def test_a_variant_on_a_scenario_it_does_not_apply_to_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert scenario_names(["c"], "more-prefixes") == ["c@more-prefixes"]
    assert scenario_names(["c", "d"], None) == ["c", "d"]
    with pytest.raises(ValueError, match="applies to scenarios c only, not to d"):
        build_scenario("d@more-prefixes", duration_s=16)
    with pytest.raises(ValueError, match="unknown variant"):
        build_scenario("c@nope", duration_s=16)
    assert main(["run", "--variant", "key-skew", "--scenarios", "c,h"]) == 2
    assert "variant key-skew applies to scenarios h only, not to c." in capsys.readouterr().err
