"""The server says what runs: xds_build_info with its version and Python's, and the
process metrics every Prometheus client exports; in each server's own registry."""

from __future__ import annotations

import platform
from importlib import metadata

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from xds_server.telemetry import Telemetry
from xds_server.telemetry.build_info import package_version


def test_build_info_process_and_python_metrics_in_every_servers_registry() -> None:
    first, second = Telemetry(), Telemetry()  # two servers in one process do not collide
    assert package_version() == metadata.version("xds-server")
    for telemetry in (first, second):
        registry = telemetry.registry
        labels = {"version": package_version(), "python_version": platform.python_version()}
        assert registry.get_sample_value("xds_build_info", labels) == 1
        assert (registry.get_sample_value("process_start_time_seconds") or 0) > 0
        assert (registry.get_sample_value("process_resident_memory_bytes") or 0) > 0
        assert (registry.get_sample_value("process_open_fds") or 0) > 0
        families = {
            f.name for f in text_string_to_metric_families(generate_latest(registry).decode())
        }
        assert {"python_info", "process_cpu_seconds", "xds_event_loop_lag_seconds"} <= families
