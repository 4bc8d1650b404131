"""The snapshot builder rebuilds only what changed, and a build that fails part way leaves
nothing of itself behind."""

from __future__ import annotations

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server import snapshot_builder
from xds_server.config import RoutingConfig, parse_config
from xds_server.errors import ResourceBuildError
from xds_server.snapshot_builder import SnapshotBuilder
from xds_server.xds.resources import ResourceType


def _config(weight: int, *, port: int = 8080) -> RoutingConfig:
    return parse_config(
        f"""
        listener: {{port: {port}}}
        pools:
          - name: a
            models: [m]
            gpu_aware: false
            endpoints: [{{address: 10.0.0.1, port: 8000, weight: {weight}}}]
          - name: b
            models: [n]
            gpu_aware: false
            endpoints: [{{address: 10.0.0.2, port: 8000}}]
        """
    )


def _weight(snapshot: object, pool: str) -> int:
    resource = snapshot.resources[ResourceType.ENDPOINT][pool]  # type: ignore[attr-defined]
    assignment = resource.message
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    return int(assignment.endpoints[0].lb_endpoints[0].load_balancing_weight.value)


def test_one_pools_change_rebuilds_that_pool_alone() -> None:
    builder = SnapshotBuilder()
    first = builder.build(_config(1))
    second = builder.build(_config(5))
    endpoints = ResourceType.ENDPOINT
    assert _weight(second, "a") == 5
    # b's assignment is the very same Resource: not rebuilt, not re-serialized.
    assert second.resources[endpoints]["b"] is first.resources[endpoints]["b"]
    for other in (ResourceType.CLUSTER, ResourceType.LISTENER, ResourceType.ROUTE):
        assert second.versions[other] == first.versions[other]


def test_a_build_that_fails_part_way_loses_no_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that fails after the assignments were made (here: the routes) must not
    leave them cached as if sent: the next build, back on the old routing, still has a's
    new weight to put in the snapshot."""
    builder = SnapshotBuilder()
    builder.build(_config(1))

    def broken(*args: object, **kwargs: object) -> None:
        raise ResourceBuildError("a route that cannot be built")

    with monkeypatch.context() as patch:
        patch.setattr(snapshot_builder.envoy, "build_routes", broken)
        with pytest.raises(ResourceBuildError):
            builder.build(_config(5, port=9090))
    assert _weight(builder.build(_config(5)), "a") == 5
