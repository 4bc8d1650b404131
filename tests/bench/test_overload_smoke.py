"""Scenario f (overload) in a seconds-long run: flow control's invariants through a real
Envoy, this server's admission, LRS and RTDS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main

pytestmark = pytest.mark.slow  # A benchmark run end to end: the slow tier


def test_quick_overload_refuses_by_band_with_retry_after(tmp_path: Path) -> None:
    argv = ["run", "--scenarios", "f", "--policies", "project", "--quick", "--out", str(tmp_path)]
    assert main(argv) == 0
    scenario = json.loads((tmp_path / "results.json").read_text())["scenarios"]["f"]
    assert scenario["capacity_tokens_per_s"] > 0
    project = scenario["policies"]["project"]
    refused = project["refused_by_band"]
    # Twice the fleet's capacity: somebody is refused, never Critical, Sheddable the most.
    assert refused["critical"] == 0
    assert refused["sheddable"] > 0
    fractions = project["refused_fraction_by_band"]
    assert fractions["sheddable"] >= fractions["standard"]
    assert project["retry_after_missing"] == 0
    assert project["server_errors"] == 0
    assert project["goodput_tokens_per_s"] > 0
    assert set(project["status_counts"]) <= {"200", "429"}
