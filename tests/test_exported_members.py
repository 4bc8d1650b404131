"""Every module declares a sorted `__all__` whose names exist (httpx's habit)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import llm_sim
import xds_server
import xds_testbed

MODULES = sorted(
    name
    for package in (xds_server, llm_sim, xds_testbed)
    for name in [
        package.__name__,
        *(m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")),
    ]
)
# Entry points that only run; they export nothing.
NO_EXPORTS = {
    "xds_server",
    "xds_server.__main__",
    "llm_sim.loadgen.__main__",
    "xds_testbed.__main__",
}


@pytest.mark.parametrize("module_name", [m for m in MODULES if m not in NO_EXPORTS])
def test_all_is_sorted_and_complete(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = module.__all__
    assert list(exported) == sorted(exported), f"{module_name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported)
    for name in exported:
        assert hasattr(module, name), f"{module_name}.__all__ names missing {name}"
