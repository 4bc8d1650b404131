"""The image's pinned dependencies (image-requirements.txt) cover pyproject.toml's.

The Dockerfile installs exactly those pins, each checked against its hashes, and then the
server's wheel without dependencies: a dependency added to pyproject.toml but not to the
lock, or a pin outside its range, would only show at `docker build` (pip check) or, worse,
at run time. Checked here on the text, as tests/test_dockerfile.py checks the Dockerfile.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "image-requirements.txt"

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*\\?$")


def _pins() -> dict[str, tuple[Version, int]]:
    """name -> (pinned version, number of hashes)."""
    pins: dict[str, tuple[Version, int]] = {}
    name = None
    for line in LOCK.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            name = canonicalize_name(match[1])
            assert name not in pins, f"{name} is pinned twice"
            pins[name] = (Version(match[2]), 0)
        elif line.strip().startswith("--hash=sha256:") and name is not None:
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
        elif line.strip() and not line.lstrip().startswith("#"):
            raise AssertionError(f"unexpected line in {LOCK.name}: {line!r}")
    return pins


def test_every_runtime_dependency_is_pinned_within_its_range() -> None:
    pins = _pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is a dependency but image-requirements.txt has no pin"
        version, _ = pins[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{name}=={version} is outside pyproject.toml's {requirement.specifier}"
        )


def test_every_pin_has_its_hashes() -> None:
    pins = _pins()
    assert pins
    assert all(hashes >= 1 for _, hashes in pins.values()), [
        name for name, (_, hashes) in pins.items() if hashes == 0
    ]


def test_the_image_installs_the_pins_only() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "--require-hashes --no-deps -r /wheels/image-requirements.txt" in dockerfile
    assert "pip install --no-deps /wheels/xds_server-" in dockerfile
    assert "pip check" in dockerfile
