"""The RTDS runtime layer: its builder, and SnapshotBuilder re-sending only RTDS for it."""

from __future__ import annotations

import math

import pytest
from google.protobuf import json_format

from xds_server.config import BANDS, RoutingConfig
from xds_server.envoy import build_runtime, names
from xds_server.envoy.routes import retry_after_of
from xds_server.envoy.runtime import admission_layer
from xds_server.errors import ResourceBuildError
from xds_server.policy.admission import UNLIMITED, PoolAdmission
from xds_server.policy.decision import Decision
from xds_server.snapshot_builder import SnapshotBuilder
from xds_server.xds.resources import ResourceType

LIMIT = "circuit_breakers.alpha/critical.default.max_requests"


def _admission(standard: int, *, retry_after_s: int = 1) -> PoolAdmission:
    return PoolAdmission(
        capacity=10,
        in_flight=dict.fromkeys(BANDS, 0),
        budget={"critical": UNLIMITED, "standard": standard, "sheddable": 0},
        max_requests={"critical": UNLIMITED, "standard": standard, "sheddable": 0},
        by_envoy={},
        retry_after_s=dict.fromkeys(BANDS, retry_after_s),
    )


def _limits(standard: int) -> Decision:
    return Decision(admissions={"alpha": _admission(standard)})


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
        ({"": 1}, ResourceBuildError),
        ({"k": math.inf}, ResourceBuildError),
        ({"k": math.nan}, ResourceBuildError),
        ({"k": None}, TypeError),
        ({"k": [1]}, TypeError),
    ],
)
def test_bad_values_are_refused(layer: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        build_runtime(layer)  # type: ignore[arg-type]


def test_a_runtime_only_change_rebuilds_only_rtds(config: RoutingConfig) -> None:
    builder = SnapshotBuilder()
    first = builder.build(config, _limits(4))
    assert first.names(ResourceType.RUNTIME) == {names.RUNTIME_LAYER_NAME}
    second = builder.build(config, _limits(5))
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
    third = builder.build(fewer, _limits(5))
    assert third.resources[ResourceType.RUNTIME] is second.resources[ResourceType.RUNTIME]
    assert {t for t in ResourceType if third.versions[t] != second.versions[t]} == {
        ResourceType.ENDPOINT
    }


def test_a_pools_admission_limits_every_band_cluster_of_every_lane(
    affinity_config: RoutingConfig,
) -> None:
    # One limit per band, on each lane's band cluster (pool, session, long); pools the
    # config does not have are left out.
    admissions = {"llm": _admission(7), "gone": _admission(3)}
    layer = admission_layer(affinity_config, admissions)
    assert layer == {
        f"circuit_breakers.{cluster}.default.max_requests": limit
        for band, limit in (("critical", UNLIMITED), ("standard", 7), ("sheddable", 0))
        for cluster in (f"llm/{band}", f"llm/session/{band}", f"llm/long/{band}")
    }


def test_a_retry_after_only_change_rebuilds_only_rds(config: RoutingConfig) -> None:
    # Retry-After is a property of the band routes (route metadata the 429 prints).
    flow = config.flow_control.model_copy(update={"enabled": True})
    config = config.model_copy(update={"flow_control": flow})
    builder = SnapshotBuilder()
    first = builder.build(config, Decision(admissions={"alpha": _admission(4, retry_after_s=2)}))
    second = builder.build(config, Decision(admissions={"alpha": _admission(4, retry_after_s=5)}))
    assert retry_after_of({"alpha": _admission(4, retry_after_s=5)})[("alpha", "standard")] == 5
    assert {t for t in ResourceType if first.versions[t] != second.versions[t]} == {
        ResourceType.ROUTE
    }
