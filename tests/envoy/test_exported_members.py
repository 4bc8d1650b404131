"""Every module of the packages owned here declares a sorted `__all__` whose names exist."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import xds_server.envoy
import xds_server.local

MODULES = sorted(
    name
    for package in (xds_server.envoy, xds_server.local)
    for name in [package.__name__]
    + [m.name for m in pkgutil.iter_modules(package.__path__, package.__name__ + ".")]
)


@pytest.mark.parametrize("module_name", MODULES)
def test_all_is_sorted_and_complete(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = module.__all__
    assert list(exported) == sorted(exported)
    assert len(set(exported)) == len(exported)
    for name in exported:
        assert hasattr(module, name), f"{module_name}.__all__ names missing {name}"


def test_pure_package_imports_no_io() -> None:
    # import-linter checks this too; this keeps the check in the test run.
    for module_name in MODULES:
        if not module_name.startswith("xds_server.envoy"):
            continue
        source = importlib.import_module(module_name).__file__
        assert source is not None
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
        for banned in ("import aiohttp", "import grpc", "xds_server.xds", "xds_server.local"):
            assert banned not in text, f"{module_name} imports {banned}"
