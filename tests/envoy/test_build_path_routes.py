"""The closed data path in the route table: the allow-list of forwarded paths, the model
list and model objects Envoy serves itself, and the JSON 404 and 405s (routes.py, 0-9)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.envoy.conftest import AFFINITY_YAML, CONFIG_YAML
from xds_server.config import RoutingConfig, parse_config
from xds_server.envoy import build_routes, names
from xds_server.envoy.routes import (
    FORWARDED_PATHS,
    MAX_ECHOED_PATH_CHARS,
    MODEL_CREATED,
    MODELS_PATH,
)

REWRITES_YAML = """
model_rewrites:
  - model: canary
    targets:
      - {model: base, weight: 3}
      - {model: plain-model, weight: 1}
      - {model: rr-model, weight: 0}
"""


def _routes(config: RoutingConfig) -> list[Any]:
    route_config = build_routes(config)[0]
    return list(route_config.virtual_hosts[0].routes)


def _by_name(config: RoutingConfig) -> dict[str, Any]:
    return {r.name: r for r in _routes(config)}


def _method(route: Any) -> tuple[str, bool] | None:
    """The `:method` a route asks for, and whether it asks for any other instead."""
    methods = [h for h in route.match.headers if h.name == ":method"]
    if not methods:
        return None
    (method,) = methods
    return method.string_match.exact, method.invert_match


def _document(route: Any) -> Any:
    """The JSON body of a 200 direct response, checking how it is sent."""
    response = route.direct_response
    assert response.status == 200
    assert response.body_format.content_type == "application/json"
    assert response.body_format.text_format_source.inline_string == "%LOCAL_REPLY_BODY%"
    return json.loads(response.body.inline_string)


def _error(route: Any) -> Any:
    return route.direct_response.body_format.json_format["error"]


def _models_of(config: RoutingConfig) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = _document(_by_name(config)["models/list"])["data"]
    return data


# -- the allow-list ------------------------------------------------------------------------


def test_the_allow_list() -> None:
    assert FORWARDED_PATHS == ("/v1/chat/completions", "/v1/completions")
    assert MODELS_PATH == "/v1/models"


def test_only_the_forwarded_paths_reach_a_pool(affinity_config: RoutingConfig) -> None:
    forwarding = [r for r in _routes(affinity_config) if r.HasField("route")]
    *to_pools, unrouted = forwarding
    assert unrouted.name == "unrouted"
    assert to_pools
    for route in to_pools:
        assert route.match.WhichOneof("path_specifier") == "safe_regex", route.name
        regex = route.match.safe_regex.regex
        # RE2 and Python agree on this alternation of literal paths.
        assert {p for p in FORWARDED_PATHS if re.fullmatch(regex, p)} == set(FORWARDED_PATHS)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(alphabet="/v1chatompleinsdrxy.%2F?#;:@", max_size=30),
        st.sampled_from(FORWARDED_PATHS).map(lambda p: p + "/"),
        st.sampled_from(FORWARDED_PATHS).map(str.upper),
        st.sampled_from(FORWARDED_PATHS).map(lambda p: p.replace("/", "//", 1)),
        st.sampled_from(FORWARDED_PATHS).map(lambda p: p.replace("/c", "/./c", 1)),
    )
)
def test_the_forwarded_regex_takes_exactly_the_allow_list(path: str) -> None:
    assert bool(re.fullmatch(_FORWARDED_REGEX, path)) == (path in FORWARDED_PATHS)


_FORWARDED_REGEX = next(
    r.match.safe_regex.regex for r in _routes(parse_config(CONFIG_YAML)) if r.HasField("route")
)


def test_every_route_but_the_last_waits_for_json_to_metadata(
    affinity_config: RoutingConfig,
) -> None:
    # So the local reply mappers can tell the routes' own replies (listeners.py), and the
    # headers-only match is always the forwarding `unrouted` (the body buffer limit).
    *routes, unrouted = _routes(affinity_config)
    for route in routes:
        keys = [[p.key for p in m.path] for m in route.match.dynamic_metadata]
        assert [names.MODEL_KEY] in keys, route.name
        assert all(m.filter == names.METADATA_NAMESPACE for m in route.match.dynamic_metadata)
    assert unrouted.name == "unrouted"
    assert not unrouted.match.dynamic_metadata


def test_any_other_path_is_a_json_404(config: RoutingConfig) -> None:
    routes = _routes(config)
    not_found = routes[-2]
    assert not_found.name == "error/not_found"
    assert not_found.match.prefix == "/"
    assert not not_found.match.headers
    assert not_found.direct_response.status == 404
    error = _error(not_found)
    assert error["code"] == "not_found"
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None
    echoed = f"%REQ(:METHOD):32% %REQ(:PATH):{MAX_ECHOED_PATH_CHARS}%"
    assert error["message"] == f"Invalid URL ({echoed})."


def test_other_methods_on_served_paths_are_405_with_allow(config: RoutingConfig) -> None:
    by_name = _by_name(config)
    expected = {
        "/v1/models": ("path", "GET"),
        "/v1/models/": ("prefix", "GET"),
        "/v1/chat/completions": ("path", "POST"),
        "/v1/completions": ("path", "POST"),
    }
    for path, (kind, allowed) in expected.items():
        route = by_name[f"error/method_not_allowed{path}"]
        assert getattr(route.match, kind) == path
        assert route.direct_response.status == 405
        assert _error(route)["code"] == "method_not_allowed"
        assert [(h.header.key, h.header.value) for h in route.response_headers_to_add] == [
            ("allow", allowed)
        ]
        # GET routes come before and take GET; the POST paths ask for "not POST".
        assert _method(route) == (None if allowed == "GET" else ("POST", True))


# -- the model list and the model objects ----------------------------------------------------


def test_the_model_list_is_openais_shape(affinity_config: RoutingConfig) -> None:
    route = _by_name(affinity_config)["models/list"]
    assert route.match.path == MODELS_PATH
    assert _method(route) == ("GET", False)
    document = _document(route)
    assert document["object"] == "list"
    assert document["data"] == [
        {"id": "base", "object": "model", "created": 0, "owned_by": "llm"},
        {"id": "lora-a", "object": "model", "created": 0, "owned_by": "llm", "parent": "base"},
        {"id": "lora-b", "object": "model", "created": 0, "owned_by": "llm", "parent": "base"},
        {"id": "plain-model", "object": "model", "created": 0, "owned_by": "plain"},
        {"id": "rr-lora", "object": "model", "created": 0, "owned_by": "rr", "parent": "rr-model"},
        {"id": "rr-model", "object": "model", "created": 0, "owned_by": "rr"},
    ]
    assert MODEL_CREATED == 0


def test_a_rewritten_name_is_listed_with_the_pools_it_splits_to() -> None:
    config = parse_config(AFFINITY_YAML + REWRITES_YAML)
    by_id = {m["id"]: m for m in _models_of(config)}
    # rr-model has weight 0: its pool takes none of the split.
    assert by_id["canary"] == {
        "id": "canary",
        "object": "model",
        "created": 0,
        "owned_by": "llm or plain",
    }
    assert list(by_id) == sorted(by_id)


def test_a_split_over_pools_found_by_selector_is_listed_too() -> None:
    # Pools from Kubernetes have a `selector` (a dict inside: PoolConfig is not hashable).
    config = parse_config(
        """
pools:
  - {name: a, models: [m], selector: {match_labels: {app: a}, target_port: 8000}}
  - {name: b, models: [n], selector: {match_labels: {app: b}, target_port: 8000}}
model_rewrites:
  - model: chat
    targets: [{model: m, weight: 3}, {model: n, weight: 1}]
"""
    )
    assert {m["id"]: m["owned_by"] for m in _models_of(config)} == {
        "chat": "a or b",
        "m": "a",
        "n": "b",
    }


def test_each_model_has_its_object_under_each_encoding_of_its_id(config: RoutingConfig) -> None:
    listed = {m["id"]: m for m in _models_of(config)}
    retrieve = {
        r.match.path: _document(r) for r in _routes(config) if r.name.startswith("models/retrieve/")
    }
    assert retrieve == {
        "/v1/models/model-a": listed["model-a"],
        "/v1/models/model-e": listed["model-e"],
        # A literal % is always encoded; `/` once encoded (the OpenAI SDK), once not.
        "/v1/models/50%25-model": listed["50%-model"],
        "/v1/models/org%2FModel-A.2": listed["org/Model-A.2"],
        "/v1/models/org/Model-A.2": listed["org/Model-A.2"],
    }
    for route in _routes(config):
        if route.name.startswith("models/"):
            assert _method(route) == ("GET", False)


def test_an_unknown_model_id_is_openais_404(config: RoutingConfig) -> None:
    routes = _routes(config)
    names_ = [r.name for r in routes]
    unknown = routes[names_.index("error/unknown_model_id")]
    # Right after the model list and every model's own route.
    assert names_[names_.index("models/list") : names_.index(unknown.name)] == [
        r.name for r in routes if r.name.startswith("models/")
    ]
    assert unknown.match.prefix == MODELS_PATH + "/"
    assert _method(unknown) == ("GET", False)
    assert unknown.direct_response.status == 404
    error = _error(unknown)
    assert (error["code"], error["param"], error["type"]) == (
        "model_not_found",
        "model",
        "invalid_request_error",
    )


def test_names_needing_json_escapes_stay_valid_json() -> None:
    config = parse_config(CONFIG_YAML.replace("model-e", '"q\\"uote\\\\d ünï"'))
    ids = [m["id"] for m in _models_of(config)]
    assert 'q"uote\\d ünï' in ids
    paths = [r.match.path for r in _routes(config) if r.name.startswith("models/retrieve/")]
    assert "/v1/models/q%22uote%5Cd%20%C3%BCn%C3%AF" in paths


def test_a_long_model_list_raises_envoys_direct_response_limit(config: RoutingConfig) -> None:
    route_config = build_routes(config)[0]
    assert route_config.max_direct_response_body_size_bytes.value == 4096
    adapters = tuple(f"adapter-{i:04d}-{'x' * 40}" for i in range(200))
    pool = config.pools[0].model_copy(update={"adapters": adapters})
    route_config = build_routes(config.model_copy(update={"pools": (pool, *config.pools[1:])}))[0]
    (listing,) = [r for r in route_config.virtual_hosts[0].routes if r.name == "models/list"]
    body = listing.direct_response.body.inline_string
    assert len(body) > 4096
    assert route_config.max_direct_response_body_size_bytes.value == len(body.encode())


# -- determinism ---------------------------------------------------------------------------------


def test_the_route_config_is_the_same_bytes_every_time() -> None:
    config = parse_config(AFFINITY_YAML + REWRITES_YAML)
    first = build_routes(config)[0].SerializeToString(deterministic=True)
    assert build_routes(config)[0].SerializeToString(deterministic=True) == first


def test_the_model_list_does_not_depend_on_the_pools_order() -> None:
    config = parse_config(AFFINITY_YAML + REWRITES_YAML)
    pools = list(config.pools)
    random.Random(7).shuffle(pools)
    shuffled = config.model_copy(update={"pools": tuple(reversed(pools))})
    paths = {r.name: r for r in _routes(config) if r.name.startswith("models/")}
    again = {r.name: r for r in _routes(shuffled) if r.name.startswith("models/")}
    assert paths == again


def test_path_routes_use_only_exact_and_prefix_matches(config: RoutingConfig) -> None:
    # No regex on a client's path in the routes Envoy answers itself (RE2 program size
    # limits, and nothing to get wrong).
    for route in _routes(config):
        if route.name.startswith(("models/", "error/method_not_allowed", "error/not_found")):
            assert route.match.WhichOneof("path_specifier") in {"path", "prefix"}, route.name
            assert route.WhichOneof("action") == "direct_response"
