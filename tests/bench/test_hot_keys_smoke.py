"""Scenario h (hot keys) in a seconds-long run through a real Envoy: the keys stay where
they should, and results.json carries the figures of bench/affinity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main

pytestmark = pytest.mark.slow  # A benchmark run end to end: the slow tier


def test_quick_hot_keys_keep_light_keys_home_and_report_the_spill(tmp_path: Path) -> None:
    # h's 256-token prefixes save too little for stickiness to pay, so by default the pool
    # suspends it after a busy streak (policy/affinity.py; tests/e2e/test_key_homes.py).
    # Here the keys must stick, for the spill to be seen: any saving pays. And the keys stay
    # where the hash put them (`home_max_factor` 1: neither the placement of logged keys nor
    # the spill rule's moves, which move some light keys in the first seconds, 0.79 on home
    # in the clean .ci/run at 29bac37; tests/e2e/test_key_homes.py tests those): "home" is
    # the hash's, and the spill alone sends a key elsewhere.
    always = '{"advanced": {"affinity_min_cached_tokens": 0, "home_max_factor": 1}}'
    argv = [
        "run", "--scenarios", "h", "--policies", "round_robin,project", "--quick",
        "--project-balancing", always,
    ]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path)]) == 0
    policies = json.loads((tmp_path / "results.json").read_text())["scenarios"]["h"]["policies"]
    for name, summary in policies.items():
        assert summary["status_counts"].get("200", 0) > 0.9 * summary["requests"], name
        sticky, spill = summary["key_stickiness"], summary["spill_reaction_s"]
        assert set(sticky) >= {"heavy", "heavy_homes", "light_unloaded", "light_all"}, name
        assert set(sticky["heavy"]) == {f"user-heavy-{k}" for k in range(3)}, name
        assert set(spill) >= {"episodes", "spilled", "median", "max", "stayed_max_s"}, name
    project, rr = policies["project"], policies["round_robin"]
    # The project keeps the light keys of the pods no heavy key lives on where they are;
    # round robin scatters every key.
    unloaded = project["key_stickiness"]["light_unloaded"]
    assert unloaded["keys"] > 0 and unloaded["weighted"] >= 0.8, unloaded
    scattered = rr["key_stickiness"]["light_all"]["weighted"]
    assert scattered < unloaded["weighted"] - 0.15, rr["key_stickiness"]
    # The heaviest key is more than one pod's work: the server takes its pod off the
    # session table (at 80% of the batch limit, mostly before it queues: queue episodes
    # here last 100-150 ms, less than a scrape interval, so the decision may come after
    # one ends), and some of the key's requests go elsewhere meanwhile.
    queues = json.loads((tmp_path / "traces" / "h-seed1-project-queues.json").read_text())
    assert any(pod[1] for _, pods in queues["decisions"] for pod in pods.values())
    assert project["key_stickiness"]["heavy"]["user-heavy-0"] < 1.0, project["key_stickiness"]
    assert "| project |" in (tmp_path / "results.md").read_text()
