"""The checked-in example config stays valid."""

from __future__ import annotations

from pathlib import Path

from xds_server.config import load_config
from xds_server.controller import SnapshotBuilder
from xds_server.xds.resources import ResourceType

ROOT = Path(__file__).resolve().parents[1]


def test_example_config_loads_and_builds() -> None:
    config = load_config(ROOT / "examples" / "config.yaml")
    snapshot = SnapshotBuilder().build(config)
    assert sorted(snapshot.resources[ResourceType.CLUSTER]) == [
        "llama",
        "llama/long",
        "qwen",
        "qwen/long",
    ]
