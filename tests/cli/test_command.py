"""The command as a process: its version, a variable in place of a flag, its log lines."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from xds_server.cli.logs import JsonFormatter, TextFormatter, utc_timestamp

ROOT = Path(__file__).resolve().parents[2]
UTC_MS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def command(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xds_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **environ},
    )


def test_version_is_the_installed_packages() -> None:
    done = command("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"xds-server {metadata.version('xds-server')}\n"


def test_a_bad_variable_is_a_usage_error_naming_it() -> None:
    done = command("run", "--config", "c.yaml", "--plaintext", XDS_SERVER_XDS_PORT="http")
    assert done.returncode == 2
    assert "XDS_SERVER_XDS_PORT='http': not a valid int" in done.stderr


def test_a_variable_stands_for_a_flag_and_a_flag_wins(tmp_path: Path) -> None:
    environ = {"XDS_SERVER_BOOTSTRAP_NODE_ID": "from-env", "XDS_SERVER_BOOTSTRAP_FORMAT": "json"}
    done = command("bootstrap", "--plaintext", **environ)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["node"]["id"] == "from-env"
    done = command("bootstrap", "--plaintext", "--node-id", "from-flag", **environ)
    assert json.loads(done.stdout)["node"]["id"] == "from-flag"


def test_a_flag_that_needs_another_names_the_variable_it_came_from() -> None:
    done = command("run", "--plaintext", XDS_SERVER_CONFIGMAP="xds-server-config")
    assert done.returncode != 0
    assert "XDS_SERVER_CONFIGMAP needs --kubernetes" in done.stderr


def _record(created: float) -> logging.LogRecord:
    record = logging.LogRecord(
        "xds_server.x", logging.INFO, __file__, 1, "hello %s", ("you",), None
    )
    record.created = created
    return record


def test_times_are_utc_to_the_millisecond() -> None:
    assert utc_timestamp(0.5) == "1970-01-01T00:00:00.500Z"
    assert utc_timestamp(1_764_859_343.1239) == "2025-12-04T14:42:23.123Z"
    assert utc_timestamp(59.9999) == "1970-01-01T00:00:59.999Z"
    text = TextFormatter().format(_record(0.25))
    assert text == "1970-01-01T00:00:00.250Z INFO xds_server.x: hello you"
    entry = json.loads(JsonFormatter().format(_record(0.25)))
    assert entry == {
        "ts": "1970-01-01T00:00:00.250Z",
        "level": "info",
        "logger": "xds_server.x",
        "message": "hello you",
    }


def test_the_servers_log_lines_are_stamped_in_utc() -> None:
    for fmt in ("text", "json"):
        server = subprocess.Popen(
            [
                sys.executable, "-m", "xds_server", "--log-format", fmt, "run",
                "--config", str(ROOT / "examples" / "config.yaml"), "--plaintext",
                "--xds-port", "0", "--admin-port", "0",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert server.stderr is not None
        try:
            lines = [server.stderr.readline()]
            while "Routing config accepted" not in lines[-1] and lines[-1]:
                lines.append(server.stderr.readline())
            server.send_signal(signal.SIGINT)
            lines += server.communicate(timeout=30)[1].splitlines()
        finally:
            server.kill()
            server.wait()
        lines = [line.rstrip("\n") for line in lines if line.strip()]
        assert any("Shutting down." in line for line in lines), lines
        if fmt == "text":
            assert all(re.match(UTC_MS + " [A-Z]+ xds_server", line) for line in lines), lines
        else:
            assert all(re.fullmatch(UTC_MS, json.loads(line)["ts"]) for line in lines), lines
