"""Versions are content hashes: separate processes, and a restart, agree on every one.

Two server replicas behind one Service, or one replica before and after a restart, must
give an Envoy the same version for the same content, or every Envoy whose stream moves to
another replica is sent again everything it already has. Within one
process nothing shows an ordering that depends on the interpreter: map order in protobuf
serialization (a `Struct`'s fields), set and dict order under hash randomization. So this
runs real server processes, each with its own PYTHONHASHSEED, from one config that uses
every part of the snapshot (flow control, session affinity, LoRA adapters, a weighted
split, a GPU-aware pool with its long-prompt lane), and compares what each one publishes
on its admin port: the version of every type in `xds_snapshot_version_info` (`/metrics`),
and every resource's own hash (`/debug/snapshot`), which names the resource that differs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

CONFIG = """
listener: {address: 127.0.0.1, port: 8080}
flow_control:
  enabled: true
  objectives: {batch: -1, chat: 0, urgent: 3}
  models:
    capped: {default_band: sheddable, max_band: standard}
pools:
  - name: chat
    gpu_aware: false
    models: [base, capped]
    adapters: [sql-lora, chat-lora, code-lora]
    session_affinity: true
    endpoints:
      - {address: 10.0.0.3, port: 8000, weight: 5, hardware: h100}
      - {address: 10.0.0.1, port: 8000, weight: 2}
      - {address: 10.0.0.2, port: 8000, weight: 9, hardware: a10g}
  - name: big
    gpu_aware: false
    models: [big-model]
    session_affinity: true
    endpoints:
      - {address: 10.0.1.1, port: 9000}
  - name: gpu
    models: [gpu-model]
    adapters: [gpu-lora]
model_rewrites:
  - model: canary
    targets: [{model: base, weight: 90}, {model: big-model, weight: 10}]
balancing:
  hardware_capacity: {h100: 13, a10g: 1}
"""

TYPES = {"cds", "eds", "lds", "rds", "rtds"}

_READY_WITHIN_S = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    """An `xds-server run` process and its admin address."""

    process: subprocess.Popen[bytes]
    admin_url: str
    debug_url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_WITHIN_S
        while True:
            assert self.process.poll() is None, f"the server exited ({self.process.returncode})"
            try:
                with urllib.request.urlopen(f"{self.admin_url}/readyz", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503: no snapshot yet
            assert time.monotonic() < deadline, f"not ready within {_READY_WITHIN_S} s"
            time.sleep(0.1)

    def _get(self, path: str) -> str:
        base = self.debug_url if path.startswith("/debug/") else self.admin_url
        with urllib.request.urlopen(f"{base}{path}", timeout=5) as response:
            return str(response.read().decode())

    def published(self) -> dict[tuple[str, ...], str]:
        """(group, type) -> the type's version, from `xds_snapshot_version_info`, and
        (group, type, resource name) -> the resource's hash, from /debug/snapshot."""
        found: dict[tuple[str, ...], str] = {}
        for family in text_string_to_metric_families(self._get("/metrics")):
            if family.name == "xds_snapshot_version_info":
                for sample in family.samples:
                    key = (sample.labels["group"], sample.labels["type"])
                    assert key not in found, f"two versions of {key}"
                    found[key] = sample.labels["version"]
        groups = json.loads(self._get("/debug/snapshot"))["groups"]
        for group, types in groups.items():
            for type_name, entry in types.items():
                for name, digest in entry["resources"].items():
                    found[(group, type_name, name)] = digest
        return found


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[[str], Server]]:
    """Start `xds-server run` on the config above with PYTHONHASHSEED=`seed`; ready on return.
    Every process started is stopped at teardown."""
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    started: list[Server] = []

    def start(seed: str) -> Server:
        admin_port, debug_port = _free_port(), _free_port()
        process = subprocess.Popen(
            [
                sys.executable, "-m", "xds_server", "--log-level", "warning",
                "run", "--config", str(config),
                "--xds-port", str(_free_port()), "--admin-port", str(admin_port),
                "--debug-port", str(debug_port), "--plaintext",
            ],
            env={**os.environ, "PYTHONHASHSEED": seed},
        )  # fmt: skip
        server = Server(
            process=process,
            admin_url=f"http://127.0.0.1:{admin_port}",
            debug_url=f"http://127.0.0.1:{debug_port}",
        )
        started.append(server)
        server.wait_ready()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def _settled(server: Server) -> dict[tuple[str, ...], str]:
    """What `server` publishes, once every type has a version and two reads agree."""
    deadline = time.monotonic() + _READY_WITHIN_S
    previous = None
    while True:
        current = server.published()
        if current == previous and {key[1] for key in current if len(key) == 2} == TYPES:
            return current
        assert time.monotonic() < deadline, f"versions did not settle: {current}"
        previous = current
        time.sleep(0.5)


def test_two_processes_and_a_restart_publish_the_same_versions(
    start_server: Callable[[str], Server],
) -> None:
    first, second = start_server("1"), start_server("2")
    published = _settled(first)
    assert _settled(second) == published

    first.stop()
    restarted = start_server("3")
    assert _settled(restarted) == published
