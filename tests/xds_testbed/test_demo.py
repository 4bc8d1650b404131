"""The README's first command: the demo runs end to end and prints its comparison."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # Over ~10 s (the demo's whole run): the slow tier


def test_demo_compares_policies_on_a_simulated_fleet() -> None:
    command = [
        sys.executable,
        "-m",
        "xds_testbed",
        "demo",
        "--port",
        "0",
        "--phase-seconds",
        "2",
        "--duration",
        "0",
    ]
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "120"}
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    out = completed.stdout
    for expected in (
        "h100-0",
        "a10g-1",
        "KV cache",
        "Same traffic, two policies",
        "round robin",
        "this project",
    ):
        assert expected in out, (expected, out[-3000:])
    assert "curl -N http://127.0.0.1:" in out
    assert "errors: requests of the trace that got no complete 200" in " ".join(out.split())
    # The demo's own pool is never without pods: the server has nothing to warn about.
    assert "WARNING" not in completed.stderr, completed.stderr[-2000:]
