"""What is running: `xds_build_info{version, python_version}` (always 1), and the process
metrics every Prometheus client exports (`process_*`: CPU, memory, open files, start time;
`python_info`), so that a dashboard can tell replicas and releases apart and an alert can
join on them.
"""

from __future__ import annotations

import platform
from importlib import metadata

from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector

__all__ = ["package_version", "register_build_info"]


def package_version() -> str:
    """The installed package's version (its metadata), or "unknown (not installed)" when
    the code runs from a checkout that was never installed (`--version` says the same)."""
    try:
        return metadata.version("xds-server")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def register_build_info(registry: CollectorRegistry) -> None:
    """Add xds_build_info, process_* and python_info to `registry`."""
    info = Gauge(
        "xds_build_info",
        "Always 1; labels carry the server's version and the Python it runs on.",
        ["version", "python_version"],
        registry=registry,
    )
    info.labels(package_version(), platform.python_version()).set(1)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
