"""Scenario g (faults) in a seconds-long run: a killed pod, a reset pod, a revived pod and a
restarted control plane through a real Envoy, with every figure the issue asks for."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench import runner
from bench.__main__ import main

FAULT_KEYS = (
    "failed_before_headers",
    "cut_streams",
    "requests_to_dead_pod_after_s",
    "non_json_errors",
    "versions_changed_on_restart",
    "reconnect_s",
)


@pytest.mark.slow
def test_quick_faults_run_reports_every_figure_and_the_project_loses_nothing(
    tmp_path: Path,
) -> None:
    assert main(["run", "--scenarios", "g", "--quick", "--out", str(tmp_path)]) == 0
    policies = json.loads((tmp_path / "results.json").read_text())["scenarios"]["g"]["policies"]
    assert set(policies) == {"round_robin", "least_request", "project"}
    for name, summary in policies.items():
        assert all(key in summary for key in FAULT_KEYS), (name, summary)
        faults = summary["faults"]
        assert faults["kill_s"] < faults["reset_s"] < faults["revive_s"]
        assert faults["revive_s"] < faults["control_plane_kill_s"]
        assert summary["reconnect_s"] is not None, name
    project = policies["project"]
    assert project["failed_before_headers"] == 0, project["status_counts"]
    assert project["non_json_errors"] == 0
    # With every pod idle a restart re-versions nothing (tests/test_determinism.py); under
    # load the project's endpoint weights follow the pods' queues, which move between the
    # old server's last scrape and the new one's first, so EDS alone may differ.
    assert set(project["versions_changed_on_restart"]) <= {"eds"}
    assert "| project |" in (tmp_path / "results.md").read_text()


async def test_a_fault_schedule_that_hangs_fails_the_run_naming_where_it_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "_FAULTS_AFTER_REPLAY_S", 0.05)
    never = asyncio.Event()

    async def restart_control_plane() -> dict[str, float]:
        await never.wait()
        return {}

    async def inject_faults() -> dict[str, float]:
        return await restart_control_plane()

    schedule = asyncio.create_task(inject_faults())
    with pytest.raises(RuntimeError, match="not done") as failure:
        await runner._fault_figures(schedule)
    where = str(failure.value)
    assert "in restart_control_plane <- " in where and where.endswith("in inject_faults"), where
    assert not schedule.done()  # the runner's exit stack cancels it, as for a finished replay
    schedule.cancel()
