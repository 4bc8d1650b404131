"""The checked-in example config stays valid, and says what it does."""

from __future__ import annotations

from pathlib import Path

from xds_server.config import load_config
from xds_server.controller import SnapshotBuilder
from xds_server.xds.resources import ResourceType

ROOT = Path(__file__).resolve().parents[1]


def test_example_config_loads_and_builds() -> None:
    config = load_config(ROOT / "examples" / "config.yaml")
    snapshot = SnapshotBuilder().build(config)
    assert sorted(snapshot.resources[ResourceType.CLUSTER]) == ["llama", "llama/long", "qwen"]


def test_only_the_static_pool_sends_its_weights() -> None:
    # The example's comments: `weight` sets the share only with `gpu_aware: false`.
    config = load_config(ROOT / "examples" / "config.yaml")
    by_pool = {pool.name: pool for pool in config.pools}
    assert by_pool["llama"].weights_from_metrics
    assert not by_pool["qwen"].weights_from_metrics
    snapshot = SnapshotBuilder().build(config)
    assignment = snapshot.resources[ResourceType.ENDPOINT]["qwen"].message
    weights = [
        endpoint.load_balancing_weight.value
        for locality in assignment.endpoints
        for endpoint in locality.lb_endpoints
    ]
    assert weights == [3, 1]
