from __future__ import annotations

from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2

from xds_server.config import RoutingConfig
from xds_server.envoy import build_routes, names


def _routes(config: RoutingConfig) -> list[Any]:
    (route_config,) = build_routes(config)
    (virtual_host,) = route_config.virtual_hosts
    return list(virtual_host.routes)


def _metadata_value(route: Any) -> Any:
    (matcher,) = route.match.dynamic_metadata
    assert matcher.filter == names.METADATA_NAMESPACE
    assert [p.key for p in matcher.path] == [names.MODEL_KEY]
    return matcher.value


def test_one_route_config_with_one_catch_all_virtual_host(config: RoutingConfig) -> None:
    (route_config,) = build_routes(config)
    assert route_config.name == names.ROUTE_CONFIG_NAME
    assert route_config.HasField("validate_clusters")
    assert not route_config.validate_clusters.value
    (virtual_host,) = route_config.virtual_hosts
    assert list(virtual_host.domains) == ["*"]
    assert virtual_host.request_body_buffer_limit.value == 10 * 1024 * 1024
    assert not virtual_host.HasField("per_request_buffer_limit_bytes")


def test_route_order(config: RoutingConfig) -> None:
    assert [r.name for r in _routes(config)] == [
        "model/model-a",
        "model/org/Model-A.2",
        "model/50%-model",
        "model/model-e",
        "header/model-a",
        "header/org/Model-A.2",
        "header/50%-model",
        "header/model-e",
        "error/unknown_header_model",
        "error/missing_model",
        "error/invalid_body",
        "error/unknown_model",
        "error/model_not_string",
        "unrouted",
    ]
    assert all(r.match.prefix == "/" for r in _routes(config))


def test_body_model_routes_to_its_pool(config: RoutingConfig) -> None:
    by_name = {r.name: r for r in _routes(config)}
    for model, pool in [("model-a", "alpha"), ("org/Model-A.2", "alpha"), ("model-e", "empty")]:
        route = by_name[f"model/{model}"]
        assert _metadata_value(route).string_match.exact == model
        assert not route.match.headers
        assert route.route.cluster == names.cluster_name(pool)


def test_header_routes_only_when_the_body_has_no_model(config: RoutingConfig) -> None:
    route = {r.name: r for r in _routes(config)}["header/model-a"]
    assert _metadata_value(route).string_match.exact == names.MODEL_MISSING
    (header,) = route.match.headers
    assert header.name == config.listener.model_header
    assert header.string_match.exact == "model-a"
    assert route.route.cluster == "alpha"


def test_routed_requests_carry_the_model_header(config: RoutingConfig) -> None:
    for route in _routes(config):
        if not route.HasField("route") or route.name == "unrouted":
            continue
        (option,) = route.request_headers_to_add
        assert option.header.key == names.ROUTED_MODEL_HEADER
        assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        model = route.name.split("/", 1)[1]
        # Header values are format strings: % must be doubled to stay literal.
        assert option.header.value == model.replace("%", "%%")


def test_timeout_is_disabled_by_default(config: RoutingConfig) -> None:
    for route in _routes(config):
        if route.HasField("route") and route.name != "unrouted":
            assert route.route.HasField("timeout"), route.name
            assert route.route.timeout.seconds == 0 and route.route.timeout.nanos == 0


def test_timeout_from_config(config: RoutingConfig) -> None:
    listener = config.listener.model_copy(update={"request_timeout_s": 90.5})
    routes = _routes(config.model_copy(update={"listener": listener}))
    assert routes[0].route.timeout.seconds == 90
    assert routes[0].route.timeout.nanos == 500_000_000


@pytest.mark.parametrize(
    ("name", "status", "code", "message_part"),
    [
        ("error/unknown_header_model", 404, "model_not_found", "%REQ(x-gateway-model-name):256%"),
        ("error/missing_model", 400, "missing_model", "x-gateway-model-name header"),
        ("error/invalid_body", 400, "invalid_json", "not valid JSON"),
        ("error/unknown_model", 404, "model_not_found", "%DYNAMIC_METADATA(llm:model):256%"),
        ("error/model_not_string", 400, "invalid_type", "must be a string"),
    ],
)
def test_refusals_are_openai_errors(
    config: RoutingConfig, name: str, status: int, code: str, message_part: str
) -> None:
    route = {r.name: r for r in _routes(config)}[name]
    assert route.WhichOneof("action") == "direct_response"
    assert route.direct_response.status == status
    error = route.direct_response.body_format.json_format["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    assert message_part in error["message"]


def test_refusal_matchers(config: RoutingConfig) -> None:
    by_name = {r.name: r for r in _routes(config)}
    unknown_header = by_name["error/unknown_header_model"]
    assert _metadata_value(unknown_header).string_match.exact == names.MODEL_MISSING
    assert unknown_header.match.headers[0].present_match
    assert _metadata_value(by_name["error/missing_model"]).string_match.exact == (
        names.MODEL_MISSING
    )
    assert _metadata_value(by_name["error/invalid_body"]).string_match.exact == (
        names.MODEL_INVALID
    )
    assert _metadata_value(by_name["error/unknown_model"]).string_match.safe_regex.regex
    assert _metadata_value(by_name["error/model_not_string"]).present_match


def test_headers_only_route_forwards_to_a_cluster_that_never_exists(
    config: RoutingConfig,
) -> None:
    # The stream's body buffer limit comes from the route matched on headers alone, and
    # only a forwarding route has one (routes.py docstring).
    route = _routes(config)[-1]
    assert not route.match.dynamic_metadata and not route.match.headers
    assert route.route.cluster == names.UNROUTED_CLUSTER
    assert route.route.cluster_not_found_response_code == (rc_pb2.RouteAction.INTERNAL_SERVER_ERROR)
    assert route.route.cluster not in {p.name for p in config.pools}


def test_custom_model_header(config: RoutingConfig) -> None:
    listener = config.listener.model_copy(update={"model_header": "x-model"})
    routes = _routes(config.model_copy(update={"listener": listener}))
    header_route = next(r for r in routes if r.name == "header/model-a")
    assert header_route.match.headers[0].name == "x-model"
    # The routed-model header keeps its own name.
    assert header_route.request_headers_to_add[0].header.key == names.ROUTED_MODEL_HEADER


@pytest.mark.parametrize("sentinel", sorted(names.SENTINELS))
def test_a_model_named_like_a_sentinel_is_refused(config: RoutingConfig, sentinel: str) -> None:
    pool = config.pools[0].model_copy(update={"models": (*config.pools[0].models, sentinel)})
    with pytest.raises(ValueError, match="reserved"):
        build_routes(config.model_copy(update={"pools": (pool, *config.pools[1:])}))


def test_a_model_name_that_cannot_be_a_header_value_is_refused(config: RoutingConfig) -> None:
    pool = config.pools[0].model_copy(update={"models": ("bad\nname",)})
    with pytest.raises(ValueError, match="CR, LF or NUL"):
        build_routes(config.model_copy(update={"pools": (pool, *config.pools[1:])}))
