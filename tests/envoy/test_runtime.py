"""The RTDS runtime layer: its builder, and SnapshotBuilder re-sending only RTDS for it."""

from __future__ import annotations

import math

import pytest
from google.protobuf import json_format

from xds_server.config import RoutingConfig
from xds_server.controller import SnapshotBuilder
from xds_server.envoy import build_runtime, names
from xds_server.policy.state import DesiredState
from xds_server.xds.resources import ResourceType

LIMIT = "circuit_breakers.alpha/critical.default.max_requests"


def test_one_layer_named_for_the_bootstrap_with_typed_values() -> None:
    [runtime] = build_runtime({LIMIT: 12, "b.ratio": 0.5, "a.flag": True, "c.mode": "strict"})
    assert runtime.name == names.RUNTIME_LAYER_NAME
    assert json_format.MessageToDict(runtime.layer) == {
        "a.flag": True,
        "b.ratio": 0.5,
        "c.mode": "strict",
        LIMIT: 12.0,
    }


def test_an_empty_layer_is_still_a_resource() -> None:
    # Envoy waits for its RTDS layer at start-up: the server always has one to send.
    [runtime] = build_runtime({})
    assert runtime.name == names.RUNTIME_LAYER_NAME and not runtime.layer.fields


def test_the_same_values_serialize_the_same_in_any_order() -> None:
    # Snapshots serialize deterministically: Struct keys go out sorted, so equal layers
    # have equal versions.
    one = build_runtime({"a": 1, "b": 2})[0].SerializeToString(deterministic=True)
    two = build_runtime({"b": 2, "a": 1})[0].SerializeToString(deterministic=True)
    assert one == two


@pytest.mark.parametrize(
    ("layer", "error"),
    [
        ({"": 1}, ValueError),
        ({"k": math.inf}, ValueError),
        ({"k": math.nan}, ValueError),
        ({"k": None}, TypeError),
        ({"k": [1]}, TypeError),
    ],
)
def test_bad_values_are_refused(layer: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        build_runtime(layer)  # type: ignore[arg-type]


def test_a_runtime_only_change_rebuilds_only_rtds(config: RoutingConfig) -> None:
    builder = SnapshotBuilder()
    first = builder.build(config, DesiredState(runtime={LIMIT: 4}))
    assert first.names(ResourceType.RUNTIME) == {names.RUNTIME_LAYER_NAME}
    second = builder.build(config, DesiredState(runtime={LIMIT: 5}))
    for kept in (ResourceType.CLUSTER, ResourceType.ENDPOINT, ResourceType.LISTENER):
        assert second.resources[kept] is first.resources[kept]
    assert {t for t in ResourceType if first.versions[t] != second.versions[t]} == {
        ResourceType.RUNTIME
    }
    # An endpoints-only change, runtime unchanged: only EDS.
    alpha = config.pools[0]
    fewer = config.model_copy(
        update={"pools": (alpha.model_copy(update={"endpoints": alpha.endpoints[:1]}),
                          *config.pools[1:])}
    )  # fmt: skip
    third = builder.build(fewer, DesiredState(runtime={LIMIT: 5}))
    assert third.resources[ResourceType.RUNTIME] is second.resources[ResourceType.RUNTIME]
    assert {t for t in ResourceType if third.versions[t] != second.versions[t]} == {
        ResourceType.ENDPOINT
    }
