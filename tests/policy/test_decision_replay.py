"""The policy decides every recorded input as it did when it was recorded.

tests/policy/data/decisions.json.gz holds 2,686 decisions from benchmark scenarios a–f, g2
and h, seed 1, 12 s each (`python -m bench.record_decisions --scenarios a,b,c,d,e,f,g2,h
--duration 12 --per-scenario 400`, run on commit 8e346f7, before the policy was split into
named rules). Each is
decided again, alone (its memory comes from the record), and compared field by field. A
change of behaviour on purpose re-records and says so in its commit; fields added to the
policy's outputs and memory since the recording (`ADDED_SINCE`) are left out of the
comparison: the key homes (homes.py) move a ring weight only after a window of decisions,
so a decision replayed alone, from a recorded memory without them, keeps the capacity's;
affinity (affinity.py) is suspended only after a streak of decisions, so it sticks; an
admission's `tenants` (weighted tenants' split of a band) is empty without them; the key
buckets (buckets.py: `buckets`, `key_buckets`, `key_offers`, `key_spare`) came after the
recording.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench.decision_records import Recording, decode_inputs, decode_memory, encode, load
from xds_server.config import RoutingConfig
from xds_server.policy.decision import decide

RECORDS = Path(__file__).parent / "data" / "decisions.json.gz"
# Output fields that did not exist when the decisions were recorded.
ADDED_SINCE: frozenset[str] = frozenset(
    {
        "reasons",
        "homes",
        "affinity",
        "keys_suspended",
        "failover",
        "tenants",
        "buckets",
        "key_buckets",
        "key_offers",
        "key_spare",
    }
)


@pytest.fixture(scope="module")
def recording() -> Recording:
    return load(RECORDS)


def test_the_recording_covers_every_rule(recording: Recording) -> None:
    """Decisions where pods spill, hold adapters, prefill long prompts, are admitted with
    flow control, and are out of rotation: a replay of idle pools would prove nothing."""
    seen: Counter[str] = Counter()
    for record in recording.decisions:
        seen[record["scenario"]] += 1
        if record["decision"]["admissions"]:
            seen["admission"] += 1
        for pool in record["decision"]["pools"].values():
            weights = {e["weight"] for e in pool["endpoints"]}
            seen["unequal weights"] += len(weights) > 1
            for endpoint in pool["endpoints"]:
                seen["spilling"] += endpoint["spilling"]
                seen["adapters"] += bool(endpoint["adapters"])
                seen["long prompt"] += endpoint["long_prompts"] > 0
                seen["ring weights"] += endpoint["ring_weight"] is not None
                seen["verdict"] += endpoint["verdict"] is not None
                seen["unhealthy"] += endpoint["health"] == "unhealthy"
    for needed in ("a", "b", "c", "d", "e", "f", "g2", "h", "admission", "unequal weights"):
        assert seen[needed] > 0, (needed, seen)
    for needed in ("spilling", "adapters", "long prompt", "ring weights", "verdict", "unhealthy"):
        assert seen[needed] > 0, (needed, seen)


def _replayed(record: dict[str, Any], config: RoutingConfig) -> tuple[Any, Any]:
    decision, memory = decide(
        decode_inputs(record["inputs"], config), decode_memory(record["memory"])
    )
    return encode(decision, leave_out=ADDED_SINCE), encode(memory, leave_out=ADDED_SINCE)


def test_every_recorded_decision_is_decided_again_the_same(recording: Recording) -> None:
    configs = [RoutingConfig.model_validate(c) for c in recording.configs]
    differing = []
    for index, record in enumerate(recording.decisions):
        decision, memory = _replayed(record, configs[record["config"]])
        if decision != record["decision"] or memory != record["next_memory"]:
            differing.append((index, record["scenario"]))
    assert not differing, f"{len(differing)} of {len(recording.decisions)} differ: {differing[:10]}"


def test_the_replay_tells_a_changed_rule(recording: Recording) -> None:
    """A coarser weight ladder (one number of Tuning) changes recorded decisions: the
    comparison above would catch a refactor that moved a weight."""
    changed = 0
    for record in recording.decisions[::10]:
        document = recording.configs[record["config"]]
        balancing = {**document["balancing"], "advanced": {"weight_ladder": 1.3}}
        config = RoutingConfig.model_validate({**document, "balancing": balancing})
        decision, _ = _replayed(record, config)
        changed += decision != record["decision"]
    assert changed > 10
