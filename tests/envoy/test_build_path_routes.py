"""The closed data path in the route table: the paths of each pool's APIs (`pools[].api`),
the model list and model objects Envoy serves itself, and the JSON 404 and 405s
(routes.py, 0-9)."""

from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.envoy.conftest import AFFINITY_YAML, CONFIG_YAML
from xds_server.apis import API_PATHS, DEFAULT_APIS, paths_of
from xds_server.config import ConfigError, RoutingConfig, parse_config
from xds_server.envoy import build_routes, names
from xds_server.envoy._route_matches import MAX_ALTERNATION_CHARS, path_groups
from xds_server.envoy.routes import (
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

ALL_APIS = list(API_PATHS)
ALL_PATHS = paths_of(tuple(ALL_APIS))

# Three pools with three API lists: the default, embeddings alone, and every API.
APIS_YAML = f"""
listener: {{address: 127.0.0.1, port: 8080}}
pools:
  - {{name: chat, models: [chat-a, chat-b], adapters: [chat-lora]}}
  - {{name: embed, models: [embed-a], api: [embeddings]}}
  - {{name: every, models: [every-a], api: {json.dumps(ALL_APIS)}}}
model_rewrites:
  - model: canary
    targets: [{{model: chat-a, weight: 1}}, {{model: every-a, weight: 1}}]
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


def _paths(route: Any) -> set[str]:
    """The known paths `route` takes (RE2 and Python agree on alternations of literals)."""
    match = route.match
    if match.WhichOneof("path_specifier") == "path":
        return {match.path}
    assert match.WhichOneof("path_specifier") == "safe_regex", route.name
    return {p for p in ALL_PATHS if re.fullmatch(match.safe_regex.regex, p)}


def _base_name(route: Any) -> str:
    """A route's name without its path group (`model/m#2` -> `model/m`)."""
    return str(route.name).split("#", 1)[0]


def _paths_by_route(config: RoutingConfig, *, forwarding: bool) -> dict[str, set[str]]:
    """The paths each route (its path groups together) takes, by base name: the routes to a
    pool (`forwarding`), or the refusals of forwarded paths."""
    taken: dict[str, set[str]] = {}
    for route in _routes(config)[:-1]:
        refusal = route.name.startswith("error/") and not route.name.startswith(
            "error/method_not_allowed"
        )
        wanted = route.HasField("route") if forwarding else refusal
        if not wanted or route.match.prefix:
            continue
        paths = taken.setdefault(_base_name(route), set())
        assert not paths & _paths(route), route.name  # each path in one group only
        paths |= _paths(route)
    return taken


# -- the APIs of a pool --------------------------------------------------------------------


def test_the_default_apis_are_chat_completions_and_responses() -> None:
    assert DEFAULT_APIS == ("chat/completions", "completions", "responses")
    assert paths_of(DEFAULT_APIS) == ("/v1/chat/completions", "/v1/completions", "/v1/responses")
    assert parse_config(CONFIG_YAML).pools[0].api == DEFAULT_APIS
    assert MODELS_PATH == "/v1/models"


def test_paths_come_in_the_catalogue_order_whatever_the_configs() -> None:
    assert paths_of(("embeddings", "chat/completions")) == (
        "/v1/chat/completions",
        "/v1/embeddings",
    )
    assert paths_of(("rerank",)) == ("/rerank", "/v1/rerank", "/v2/rerank")
    assert len(set(ALL_PATHS)) == len(ALL_PATHS)


@pytest.mark.parametrize(
    ("api", "problem"),
    [
        ('[chat/completions, embedings]', "pools.0.api.1: Input should be 'chat/completions'"),
        ("[/v1/embeddings]", "pools.0.api.0: Input should be"),
        ("[]", "pools.0.api: Tuple should have at least 1 item"),
        ("[responses, responses]", "pools.0.api: Value error, APIs listed twice: responses"),
        ("embeddings", "pools.0.api: Input should be a valid tuple"),
    ],
)
def test_an_unknown_or_repeated_api_is_refused_with_its_path(api: str, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(f"pools: [{{name: p, models: [m], api: {api}}}]")
    assert problem in str(refused.value)


def test_a_split_over_pools_without_a_common_api_is_refused() -> None:
    document = """
pools:
  - {name: chat, models: [c]}
  - {name: embed, models: [e], api: [embeddings]}
model_rewrites:
  - model: mixed
    targets: [{model: c, weight: 1}, {model: e, weight: 1}]
"""
    with pytest.raises(ConfigError, match="rewrite of 'mixed' splits over pools that serve no API"):
        parse_config(document)
    # A target without weight takes no requests: its pool does not count.
    config = parse_config(document.replace("{model: e, weight: 1}", "{model: e, weight: 0}"))
    assert config.rewrite_api(config.model_rewrites[0]) == DEFAULT_APIS


def test_each_pool_is_reached_on_its_own_paths_only() -> None:
    config = parse_config(APIS_YAML)
    taken = _paths_by_route(config, forwarding=True)
    chat, embed, every = (set(paths_of(p.api)) for p in config.pools)
    expected: dict[str, set[str]] = {}
    for kind in ("model", "header"):
        for model in ("chat-a", "chat-b", "chat-lora"):
            expected[f"{kind}/{model}"] = chat
        expected[f"{kind}/embed-a"] = embed
        expected[f"{kind}/every-a"] = every
        # Envoy picks a split's target by weight: only the paths both pools serve.
        expected[f"split-{kind}/canary"] = chat
    # The other routes to a pool (long prompts, streams) take their plain route's paths.
    lanes = r"^(stream-)?(long-)?"
    for name, paths in taken.items():
        assert paths == expected[re.sub(lanes, "", name)], name
    assert expected.keys() <= taken.keys()


def test_every_forwarded_path_gets_a_405_for_other_methods_and_the_refusals() -> None:
    config = parse_config(APIS_YAML)
    by_name = _by_name(config)
    for path in ALL_PATHS:
        assert _method(by_name[f"error/method_not_allowed{path}"]) == ("POST", True)
    taken = _paths_by_route(config, forwarding=False)
    for refusal in ("unknown_header_model", "missing_model", "invalid_body", "unknown_model"):
        assert taken[f"error/{refusal}"] == set(ALL_PATHS), refusal
    # Only the paths some pool serves: the default config has no 405 for embeddings.
    defaults = {r.name for r in _routes(parse_config(CONFIG_YAML))}
    assert "error/method_not_allowed/v1/responses" in defaults
    assert "error/method_not_allowed/v1/embeddings" not in defaults


def test_a_model_on_a_path_its_pool_does_not_serve_is_a_404() -> None:
    config = parse_config(APIS_YAML)
    taken = _paths_by_route(config, forwarding=False)
    chat, embed = set(paths_of(DEFAULT_APIS)), {"/v1/embeddings"}
    assert taken["error/unserved_path/pool/chat"] == set(ALL_PATHS) - chat
    assert taken["error/unserved_path/pool/embed"] == set(ALL_PATHS) - embed
    assert taken["error/unserved_path/split/canary"] == set(ALL_PATHS) - chat
    for model in ("chat-a", "chat-b", "chat-lora", "canary"):
        assert taken[f"error/unserved_path/header/{model}"] == set(ALL_PATHS) - chat
    assert taken["error/unserved_path/header/embed-a"] == set(ALL_PATHS) - embed
    # A pool serving every path needs none; a split's name is not its pool's.
    assert not any("every" in name for name in taken if name.startswith("error/unserved"))
    by_name = _by_name(config)
    pool_route = by_name["error/unserved_path/pool/chat"]
    (model,) = pool_route.match.dynamic_metadata
    assert [m.string_match.exact for m in model.value.or_match.value_matchers] == [
        "chat-a",
        "chat-b",
        "chat-lora",
    ]
    header_route = by_name["error/unserved_path/header/chat-a"]
    (by_header,) = header_route.match.headers
    assert (by_header.name, by_header.string_match.exact) == (
        config.listener.model_header,
        "chat-a",
    )
    for route in (pool_route, header_route):
        assert route.direct_response.status == 404
        error = _error(route)
        assert (error["code"], error["param"], error["type"]) == (
            "not_found",
            None,
            "invalid_request_error",
        )
        assert error["message"].startswith("Invalid URL (%REQ(:METHOD):32% %REQ(:PATH):")
    # After every route to a pool, before the refusals of an unknown model.
    names_ = [r.name for r in _routes(config)]
    first = names_.index("error/unserved_path/pool/chat")
    assert all(r.HasField("direct_response") for r in _routes(config)[first:-1])
    assert first < names_.index("error/unknown_header_model")


def test_every_pool_serving_the_same_apis_needs_no_unserved_route(
    affinity_config: RoutingConfig,
) -> None:
    assert not [r for r in _routes(affinity_config) if r.name.startswith("error/unserved")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(ALL_PATHS), unique=True, min_size=1))
def test_path_groups_keep_every_alternation_under_re2s_limit(paths: list[str]) -> None:
    groups = path_groups(tuple(paths))
    assert [p for group in groups for p in group] == paths
    for group in groups:
        assert len("|".join(map(re.escape, group))) <= MAX_ALTERNATION_CHARS
    # Greedy: a group could not have taken the next group's first path.
    for group, following in itertools.pairwise(groups):
        joined = "|".join(map(re.escape, (*group, following[0])))
        assert len(joined) > MAX_ALTERNATION_CHARS


def test_three_or_four_apis_fit_one_route_and_every_api_two() -> None:
    assert len(path_groups(paths_of(DEFAULT_APIS))) == 1
    assert len(path_groups(paths_of((*DEFAULT_APIS, "embeddings")))) == 1
    assert len(path_groups(ALL_PATHS)) == 2


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(alphabet="/v12chatompleinsdrxyb.%2F?#;:@", max_size=30),
        st.sampled_from(ALL_PATHS).map(lambda p: p + "/"),
        st.sampled_from(ALL_PATHS).map(str.upper),
        st.sampled_from(ALL_PATHS).map(lambda p: p.replace("/", "//", 1)),
        st.sampled_from(ALL_PATHS).map(lambda p: "/." + p),
    )
)
def test_a_forwarded_regex_takes_exactly_its_paths(path: str) -> None:
    for regex, paths in _REGEXES:
        assert bool(re.fullmatch(regex, path)) == (path in paths)


_REGEXES = [
    (r.match.safe_regex.regex, _paths(r))
    for r in _routes(parse_config(APIS_YAML))
    if r.match.WhichOneof("path_specifier") == "safe_regex"
]


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
