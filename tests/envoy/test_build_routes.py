from __future__ import annotations

import re
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2

from tests.envoy.conftest import AFFINITY_YAML
from xds_server.config import RoutingConfig, parse_config
from xds_server.envoy import build_routes, names
from xds_server.envoy.listeners import HEADER_MUTATION_FILTER, PROMPT_KEY, PROMPT_NAMESPACE
from xds_server.envoy.routes import MAX_SESSION_KEY_CHARS, PROMPT_PREFIX_REGEX, SESSION_KEY_REGEX
from xds_server.errors import ResourceBuildError


def _all_routes(config: RoutingConfig) -> list[Any]:
    route_config = build_routes(config)[0]
    (virtual_host,) = route_config.virtual_hosts
    return list(virtual_host.routes)


def _routes(config: RoutingConfig) -> list[Any]:
    """The routes but the streamed requests' twins (`stream-<name>`, each just before its
    route: test_streamed_requests_have_twins_with_per_try_bounds)."""
    return [r for r in _all_routes(config) if not r.name.startswith("stream-")]


# The routes of the paths Envoy answers itself (routes.py docstring, 0 and 8).
PATH_ROUTE_PREFIXES = ("models/", "error/unknown_model_id", "error/method_not_allowed/")


def _model_routes(config: RoutingConfig) -> list[Any]:
    """The routes but those of the paths Envoy answers itself: 1-7, 9 and 10 of routes.py."""
    return [r for r in _routes(config) if not r.name.startswith(PATH_ROUTE_PREFIXES)]


def _metadata_value(route: Any) -> Any:
    (matcher,) = route.match.dynamic_metadata
    assert matcher.filter == names.METADATA_NAMESPACE
    assert [p.key for p in matcher.path] == [names.MODEL_KEY]
    return matcher.value


def test_one_route_config_with_one_catch_all_virtual_host(config: RoutingConfig) -> None:
    route_config = build_routes(config)[0]
    assert route_config.name == names.ROUTE_CONFIG_NAME
    assert route_config.HasField("validate_clusters")
    assert not route_config.validate_clusters.value
    (virtual_host,) = route_config.virtual_hosts
    assert list(virtual_host.domains) == ["*"]
    assert virtual_host.request_body_buffer_limit.value == 10 * 1024 * 1024
    assert not virtual_host.HasField("per_request_buffer_limit_bytes")


def test_route_order(config: RoutingConfig) -> None:
    models = ("model-a", "org/Model-A.2", "50%-model", "model-e")
    kinds = ("model", "header")
    retrieve = ["50%25-model", "model-a", "model-e", "org%2FModel-A.2", "org/Model-A.2"]
    assert [r.name for r in _routes(config)] == [
        "error/method_not_allowed/v1/chat/completions",
        "error/method_not_allowed/v1/completions",
        "error/method_not_allowed/v1/responses",
        *(f"{lane}{kind}/{m}" for kind in kinds for m in models for lane in ("long-", "")),
        "error/unknown_header_model",
        "error/missing_model",
        "error/invalid_body",
        "error/unknown_model",
        "error/model_not_string",
        "models/list",
        *(f"models/retrieve/{segment}" for segment in retrieve),
        "error/unknown_model_id",
        "error/method_not_allowed/v1/models",
        "error/method_not_allowed/v1/models/",
        "error/not_found",
        "unrouted",
    ]
    # Routes 1-7 take the forwarded paths only: the default APIs'.
    for route in _model_routes(config)[:-2]:
        assert (
            route.match.safe_regex.regex
            == "/v1/chat/completions|/v1/completions|/v1/responses"
        )


def test_long_prompts_route_to_the_pools_long_prompt_cluster(config: RoutingConfig) -> None:
    by_name = {r.name: r for r in _routes(config)}
    for kind in ("model", "header"):
        long_prompt, plain = by_name[f"long-{kind}/model-a"], by_name[f"{kind}/model-a"]
        *same, content_length = long_prompt.match.headers
        assert content_length.name == "content-length"
        assert content_length.range_match.start == config.balancing.long_prompt_bytes == 32_768
        assert content_length.range_match.end == 2**63 - 1
        # Otherwise the plain route's match, action and headers, to `<pool>/long`.
        assert same == list(plain.match.headers)
        assert list(long_prompt.match.dynamic_metadata) == list(plain.match.dynamic_metadata)
        assert long_prompt.route.cluster == "alpha/long"
        long_prompt.route.cluster = plain.route.cluster
        assert long_prompt.route == plain.route
        assert long_prompt.request_headers_to_add == plain.request_headers_to_add


def test_no_long_prompt_routes_when_turned_off(config: RoutingConfig) -> None:
    balancing = config.balancing.model_copy(update={"long_prompt_bytes": 0})
    off = config.model_copy(update={"balancing": balancing})
    assert not [r.name for r in _routes(off) if r.name.startswith("long-")]
    assert len(_routes(off)) == len(_routes(config)) - 8


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
    routes = _model_routes(config.model_copy(update={"listener": listener}))
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
    assert route.match.prefix == "/"
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
    with pytest.raises(ResourceBuildError, match="reserved"):
        build_routes(config.model_copy(update={"pools": (pool, *config.pools[1:])}))


def test_a_model_name_that_cannot_be_a_header_value_is_refused(config: RoutingConfig) -> None:
    pool = config.pools[0].model_copy(update={"models": ("bad\nname",)})
    with pytest.raises(ResourceBuildError, match="CR, LF or NUL"):
        build_routes(config.model_copy(update={"pools": (pool, *config.pools[1:])}))


def test_affinity_route_order(affinity_config: RoutingConfig) -> None:
    def per_model(kind: str, model: str) -> list[str]:
        # The session key first (its prefix is cached where it goes), then long prompts.
        return [
            f"session-{kind}/{model}",
            f"session-key-{kind}/{model}",
            f"long-{kind}/{model}",
            f"{kind}/{model}",
        ]

    expected = []
    for kind in ("model", "header"):
        for model in ("base", "lora-b", "lora-a"):
            expected += per_model(kind, model)
        # `rr` is round robin: no metrics weights, so no long-prompt lane.
        expected += [f"{kind}/rr-model", f"{kind}/rr-lora", f"long-{kind}/plain-model"]
        expected += [f"{kind}/plain-model"]
    names_ = [r.name for r in _model_routes(affinity_config)]
    assert names_[: len(expected)] == expected
    assert names_[len(expected) :] == [r.name for r in _model_routes(affinity_config)[-7:]]
    assert names_[-1] == "unrouted"


def test_adapter_routes_ask_for_the_adapters_subset(affinity_config: RoutingConfig) -> None:
    by_name = {r.name: r for r in _routes(affinity_config)}
    for name in (
        "model/lora-a",
        "header/lora-a",
        "session-model/lora-a",
        "session-key-header/lora-a",
    ):
        criteria = by_name[name].route.metadata_match.filter_metadata
        assert dict(criteria) == {
            names.LB_METADATA_NAMESPACE: criteria[names.LB_METADATA_NAMESPACE]
        }
        assert dict(criteria[names.LB_METADATA_NAMESPACE]) == {names.LORA_KEY: "lora-a"}
    assert _metadata_value(by_name["model/lora-a"]).string_match.exact == "lora-a"
    assert by_name["model/lora-a"].route.cluster == "llm"
    assert by_name["model/rr-lora"].route.metadata_match.filter_metadata[
        names.LB_METADATA_NAMESPACE
    ][names.LORA_KEY] == ("rr-lora")
    # Models are not adapters: no subset asked for, the fallback balances the whole pool.
    for name in ("model/base", "session-model/base", "model/plain-model"):
        assert not by_name[name].route.HasField("metadata_match"), name


def test_session_routes(affinity_config: RoutingConfig) -> None:
    by_name = {r.name: r for r in _routes(affinity_config)}
    by_header = by_name["session-model/base"]
    by_body = by_name["session-key-model/base"]
    plain = by_name["model/base"]
    for route in (by_header, by_body):
        assert route.route.cluster == "llm/session"
        (hash_policy,) = route.route.hash_policy
        assert hash_policy.header.header_name == names.SESSION_HEADER
        assert route.route.timeout == plain.route.timeout
        assert route.request_headers_to_add == plain.request_headers_to_add
    # a. The client's own non-empty header.
    (model_matcher,) = by_header.match.dynamic_metadata
    assert model_matcher.value.string_match.exact == "base"
    (header,) = by_header.match.headers
    assert header.name == names.SESSION_HEADER
    assert header.string_match.safe_regex.regex == "(?s).+"
    assert not by_header.typed_per_filter_config
    # b. The body's key, when it can be a header value; written into the header per route.
    model_matcher, key_matcher = by_body.match.dynamic_metadata
    assert model_matcher.value.string_match.exact == "base"
    assert key_matcher.filter == names.METADATA_NAMESPACE
    assert [p.key for p in key_matcher.path] == [names.SESSION_KEY]
    assert key_matcher.value.string_match.safe_regex.regex == SESSION_KEY_REGEX
    per_route = header_mutation_pb2.HeaderMutationPerRoute()
    assert by_body.typed_per_filter_config[HEADER_MUTATION_FILTER].Unpack(per_route)
    (mutation,) = per_route.mutations.request_mutations
    assert mutation.append.header.key == names.SESSION_HEADER
    assert mutation.append.header.value == (
        f"%DYNAMIC_METADATA(llm:{names.SESSION_KEY}):{MAX_SESSION_KEY_CHARS}%"
    )
    assert mutation.append.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    # c. Without a key: the pool's own cluster, no hashing.
    assert plain.route.cluster == "llm"
    assert not plain.route.hash_policy and not plain.typed_per_filter_config
    # Header variants match the model header instead of the body's model.
    header_variant = by_name["session-header/base"]
    assert header_variant.route.cluster == "llm/session"
    assert [h.name for h in header_variant.match.headers] == [
        affinity_config.listener.model_header,
        names.SESSION_HEADER,
    ]
    (model_matcher,) = header_variant.match.dynamic_metadata
    assert model_matcher.value.string_match.exact == names.MODEL_MISSING


def test_session_key_regex() -> None:
    # RE2 matches the whole value; Python's re agrees on these.
    for accepted in ("conv-1", "42", "user@example.com", "é" * 3, "a b"):
        assert re.fullmatch(SESSION_KEY_REGEX, accepted), accepted
    for refused in ("", "a\nb", "a\r\nx-injected: 1", "a\x00", "tab\there", "del\x7f"):
        assert not re.fullmatch(SESSION_KEY_REGEX, refused), refused


def _with_prefix_keys(config: RoutingConfig, prefix_bytes: int) -> RoutingConfig:
    balancing = config.balancing.model_copy(update={"prefix_key_bytes": prefix_bytes})
    return config.model_copy(update={"balancing": balancing})


def test_prefix_routes_come_after_the_session_keys_and_before_long_prompts(
    affinity_config: RoutingConfig,
) -> None:
    names_ = [r.name for r in _routes(_with_prefix_keys(affinity_config, 64))]
    for kind in ("model", "header"):
        start = names_.index(f"session-{kind}/base")
        assert names_[start : start + 5] == [
            f"session-{kind}/base",
            f"session-key-{kind}/base",
            f"prefix-{kind}/base",
            f"long-{kind}/base",
            f"{kind}/base",
        ]
    # Only pools with session affinity; off by default.
    assert not any(n.startswith("prefix-") and "plain" in n for n in names_)
    assert not any(n.startswith("prefix-") for n in (r.name for r in _routes(affinity_config)))


def test_prefix_route_hashes_the_prompts_first_bytes_as_json(
    affinity_config: RoutingConfig,
) -> None:
    by_name = {r.name: r for r in _routes(_with_prefix_keys(affinity_config, 64))}
    route = by_name["prefix-model/lora-a"]
    session = by_name["session-key-model/lora-a"]
    assert route.route.cluster == "llm/session"
    assert route.route.hash_policy == session.route.hash_policy
    assert route.route.metadata_match == session.route.metadata_match
    assert route.route.retry_policy == session.route.retry_policy
    model_matcher, prompt_matcher = route.match.dynamic_metadata
    assert model_matcher.value.string_match.exact == "lora-a"
    assert prompt_matcher.filter == PROMPT_NAMESPACE
    assert [p.key for p in prompt_matcher.path] == [PROMPT_KEY]
    assert prompt_matcher.value.string_match.safe_regex.regex == PROMPT_PREFIX_REGEX
    per_route = header_mutation_pb2.HeaderMutationPerRoute()
    assert route.typed_per_filter_config[HEADER_MUTATION_FILTER].Unpack(per_route)
    (mutation,) = per_route.mutations.request_mutations
    assert mutation.append.header.key == names.SESSION_HEADER
    # The namespace printed as JSON, `{"prompt":"` (11 bytes) and 64 bytes of the prompt.
    assert mutation.append.header.value == "%DYNAMIC_METADATA(llm.prompt):75%"
    assert mutation.append.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def test_prompt_prefix_regex() -> None:
    # Control characters are escaped in the JSON the header carries; DEL is not.
    for accepted in ("a\nb", "tab\there", "nul\x00", "é", "x" * 9000):
        assert re.fullmatch(PROMPT_PREFIX_REGEX, accepted), accepted
    for refused in ("", "del\x7f", "\x7f"):
        assert not re.fullmatch(PROMPT_PREFIX_REGEX, refused), refused


def test_prefix_routes_come_per_band_with_flow_control(affinity_config: RoutingConfig) -> None:
    flow = affinity_config.flow_control.model_copy(update={"enabled": True})
    config = _with_prefix_keys(affinity_config, 32).model_copy(update={"flow_control": flow})
    routes = [r for r in _routes(config) if r.name.startswith("prefix-model/base/")]
    assert routes
    for route in routes:
        band = route.name.split("/")[2]
        assert route.route.cluster == f"llm/session/{band}"


def test_pools_without_affinity_route_as_before(config: RoutingConfig) -> None:
    for route in _routes(config):
        assert not route.name.startswith("session"), route.name
        if route.HasField("route"):
            assert not route.route.hash_policy
            assert not route.route.HasField("metadata_match")


@pytest.mark.parametrize("sentinel", sorted(names.SENTINELS))
def test_an_adapter_named_like_a_sentinel_is_refused(
    affinity_config: RoutingConfig, sentinel: str
) -> None:
    # The config refuses these names already; the builder does not rely on it.
    pool = affinity_config.pools[0].model_construct(
        **{**dict(affinity_config.pools[0]), "adapters": (sentinel,)}
    )
    with pytest.raises(ResourceBuildError, match="reserved"):
        build_routes(affinity_config.model_copy(update={"pools": (pool,)}))


def test_a_rewritten_model_splits_by_weight_before_other_routes() -> None:
    config = parse_config(
        AFFINITY_YAML
        + """
model_rewrites:
  - model: base
    targets:
      - {model: base, weight: 9}
      - {model: lora-a, weight: 1}
      - {model: plain-model, weight: 0}
"""
    )
    routes = _model_routes(config)
    assert [r.name for r in routes[:1]] == ["split-model/base"]
    # The rewritten model has no other route (its session routes included).
    assert not [r.name for r in routes if r.name.endswith("/base") and "split" not in r.name]
    (split,) = [r for r in routes if r.name == "split-model/base"]
    assert _metadata_value(split).string_match.exact == "base"
    clusters = split.route.weighted_clusters.clusters
    assert [(c.name, c.weight.value) for c in clusters] == [("llm", 9), ("llm", 1)]
    assert [c.request_headers_to_add[0].header.value for c in clusters] == ["base", "lora-a"]
    assert not clusters[0].HasField("metadata_match")
    subset = clusters[1].metadata_match.filter_metadata[names.LB_METADATA_NAMESPACE]
    assert subset[names.LORA_KEY] == "lora-a"
    (by_header,) = [r for r in routes if r.name == "split-header/base"]
    assert by_header.match.headers[0].string_match.exact == "base"
    # The targets keep their own routes.
    assert "model/lora-a" in [r.name for r in routes]


FLOW_YAML = """
flow_control:
  enabled: true
  objectives: {batch: -1, chat: 0, urgent: 3}
  models:
    capped: {default_band: sheddable, max_band: standard}
  retry_after_min_s: 2
  retry_after_max_s: 20
pools:
  - name: p
    models: [m, capped]
  - name: q
    models: [n]
    session_affinity: true
model_rewrites:
  - model: canary
    targets: [{model: m, weight: 3}, {model: n, weight: 1}]
"""


def _band_metadata(route: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    values: dict[str, Any] = json_format.MessageToDict(
        route.metadata.filter_metadata[names.METADATA_NAMESPACE]
    )
    return values


def test_flow_control_classifies_by_objective_then_band_header_then_default() -> None:
    routes = {r.name: r for r in _routes(parse_config(FLOW_YAML))}
    m = [name for name in routes if name.startswith("model/m/")]
    assert m == [
        "model/m/sheddable/objective/batch",
        "model/m/standard/objective/chat",
        "model/m/critical/objective/urgent",
        "model/m/critical/band/critical",
        "model/m/sheddable/band/sheddable",
        "model/m/standard",
    ]
    urgent = routes["model/m/critical/objective/urgent"]
    assert urgent.route.cluster == "p/critical"
    (objective,) = urgent.match.headers
    assert objective.name == names.OBJECTIVE_HEADER
    assert objective.string_match.exact == "urgent"
    band = routes["model/m/critical/band/critical"].match.headers[-1]
    assert band.name == "x-gateway-inference-band"
    assert band.string_match.exact == "critical"
    assert band.string_match.ignore_case
    # The default route is the model's plain match, as without flow control.
    plain = {r.name: r for r in _routes(parse_config(FLOW_YAML.replace("enabled: true", "")))}
    assert routes["model/m/standard"].match == plain["model/m"].match
    assert routes["header/m/standard"].match == plain["header/m"].match


def test_flow_control_caps_at_the_models_max_band() -> None:
    routes = _routes(parse_config(FLOW_YAML))
    capped = {r.name: r.route.cluster for r in routes if r.name.startswith("model/capped/")}
    assert capped == {
        "model/capped/sheddable/objective/batch": "p/sheddable",
        "model/capped/standard/objective/chat": "p/standard",
        "model/capped/standard/objective/urgent": "p/standard",
        "model/capped/standard/band/critical": "p/standard",
        "model/capped/standard/band/standard": "p/standard",
        "model/capped/sheddable": "p/sheddable",
    }


def test_band_routes_carry_band_pool_and_retry_after() -> None:
    config = parse_config(FLOW_YAML)
    route_config = build_routes(
        config, retry_after={("p", "sheddable"): 7, ("q", "sheddable"): 99}
    )[0]
    routes = {r.name: r for r in route_config.virtual_hosts[0].routes}
    assert _band_metadata(routes["model/m/sheddable/band/sheddable"]) == {
        "band": "sheddable",
        "pool": "p",
        "retry_after_s": 7.0,
    }
    # Absent: the minimum; above the maximum: the maximum.
    assert _band_metadata(routes["model/m/standard"])["retry_after_s"] == 2.0
    assert _band_metadata(routes["model/n/sheddable/band/sheddable"])["retry_after_s"] == 20.0
    # A split: the largest of its pools', and both pools named.
    split = _band_metadata(routes["split-model/canary/sheddable/band/sheddable"])
    assert split == {"band": "sheddable", "pool": "p or q", "retry_after_s": 20.0}
    # Refusals and the unrouted route carry none.
    assert not routes["error/missing_model"].HasField("metadata")


def test_a_split_goes_to_the_band_clusters_of_its_targets() -> None:
    routes = {r.name: r for r in _routes(parse_config(FLOW_YAML))}
    for band in ("critical", "standard", "sheddable"):
        name = f"split-header/canary/{band}" + ("" if band == "standard" else f"/band/{band}")
        clusters = routes[name].route.weighted_clusters.clusters
        assert [(c.name, c.weight.value) for c in clusters] == [(f"p/{band}", 3), (f"q/{band}", 1)]


def test_session_and_long_prompt_routes_come_per_band_to_their_band_clusters() -> None:
    routes = [
        r for r in _routes(parse_config(FLOW_YAML)) if r.name.endswith("n/critical/band/critical")
    ]
    assert [(r.name, r.route.cluster) for r in routes] == [
        ("session-model/n/critical/band/critical", "q/session/critical"),
        ("session-key-model/n/critical/band/critical", "q/session/critical"),
        ("long-model/n/critical/band/critical", "q/long/critical"),
        ("model/n/critical/band/critical", "q/critical"),
        ("session-header/n/critical/band/critical", "q/session/critical"),
        ("session-key-header/n/critical/band/critical", "q/session/critical"),
        ("long-header/n/critical/band/critical", "q/long/critical"),
        ("header/n/critical/band/critical", "q/critical"),
    ]
    assert all(r.route.hash_policy for r in routes if r.name.startswith("session"))


def test_flow_control_off_ignores_retry_after() -> None:
    config = parse_config(FLOW_YAML.replace("enabled: true", "enabled: false"))
    assert build_routes(config, retry_after={("p", "standard"): 9}) == build_routes(config)
    # No band, no Retry-After: the pool alone (for the access log).
    assert {
        frozenset(_band_metadata(r)) for r in _routes(config) if r.HasField("metadata")
    } <= {frozenset({"pool"}), frozenset({"pool", "session_key_from"})}


def test_a_session_pool_has_spill_routes_to_its_own_cluster(
    affinity_config: RoutingConfig,
) -> None:
    """The spill listener's routes (listeners.py): an adapter's requests, told apart by the
    model header the listener's route set, to its holders; anything else to the pool."""
    main, spill = build_routes(affinity_config)
    assert main.name == names.ROUTE_CONFIG_NAME
    assert spill.name == names.spill_listener_name("llm") == "llm/spill"
    (virtual_host,) = spill.virtual_hosts
    by_name = {r.name: r for r in virtual_host.routes}
    assert list(by_name) == ["spill/lora-b", "spill/lora-a", "spill"]
    for adapter in ("lora-a", "lora-b"):
        route = by_name[f"spill/{adapter}"]
        (header,) = route.match.headers
        assert (header.name, header.string_match.exact) == (names.ROUTED_MODEL_HEADER, adapter)
        subset = route.route.metadata_match.filter_metadata[names.LB_METADATA_NAMESPACE]
        assert dict(subset) == {names.LORA_KEY: adapter}
    assert by_name["spill"].match.prefix == "/"
    assert not by_name["spill"].route.HasField("metadata_match")
    assert {r.route.cluster for r in by_name.values()} == {names.cluster_name("llm")}
    assert not any(r.route.hash_policy for r in by_name.values())
    assert all(r.route.retry_policy.num_retries.value > 0 for r in by_name.values())


def test_no_spill_routes_with_spill_to_ring(affinity_config: RoutingConfig) -> None:
    balancing = affinity_config.balancing.model_copy(update={"spill_to": "ring"})
    config = affinity_config.model_copy(update={"balancing": balancing})
    assert [r.name for r in build_routes(config)] == [names.ROUTE_CONFIG_NAME]


def test_spill_routes_go_to_the_pool_cluster_not_a_band_cluster() -> None:
    """The listener's route admitted the request in its band's session cluster: forwarded,
    it is not counted against the band a second time."""
    config = parse_config(AFFINITY_YAML + "flow_control: {enabled: true}\n")
    spill = {r.name: r for r in build_routes(config)}["llm/spill"]
    assert {r.route.cluster for r in spill.virtual_hosts[0].routes} == {"llm"}


def test_streamed_requests_have_twins_with_per_try_bounds(affinity_config: RoutingConfig) -> None:
    routes = _all_routes(affinity_config)
    pool_routes = [r for r in routes if r.HasField("route") and r.name != "unrouted"]
    twins = [r for r in pool_routes if r.name.startswith("stream-")]
    assert twins and len(twins) * 2 == len(
        [r for r in pool_routes if not r.name.startswith(("split-", "stream-split-"))]
    )
    for twin in twins:
        following = routes[routes.index(twin) + 1]
        assert twin.name == f"stream-{following.name}"
        # Matched only for `"stream": true`, on top of the route's own match.
        *same, stream = twin.match.dynamic_metadata
        assert list(same) == list(following.match.dynamic_metadata)
        assert [p.key for p in stream.path] == ["stream"] and stream.value.bool_match
        assert twin.route.cluster == following.route.cluster
        retry = twin.route.retry_policy
        assert retry.per_try_timeout.ToTimedelta().total_seconds() == 10
        assert retry.per_try_idle_timeout.ToTimedelta().total_seconds() == 60
        assert retry.retry_on == following.route.retry_policy.retry_on
        # The route for the rest has no bound: a request not streamed is silent until done.
        assert not following.route.retry_policy.HasField("per_try_timeout")
        assert not following.route.retry_policy.HasField("per_try_idle_timeout")


def test_pools_without_stream_bounds_have_no_twins(affinity_config: RoutingConfig) -> None:
    pools = tuple(
        p.model_copy(update={"first_byte_s": 0.0, "stream_idle_s": 0.0})
        for p in affinity_config.pools
    )
    unbounded = affinity_config.model_copy(update={"pools": pools})
    assert _all_routes(unbounded) == _routes(unbounded) == _routes(affinity_config)
    retries_off = unbounded.model_copy(
        update={"upstream": unbounded.upstream.model_copy(update={"retries": 0})}
    )
    one = affinity_config.model_copy(
        update={
            "upstream": retries_off.upstream,
            "pools": tuple(p.model_copy(update={"first_byte_s": 0.0}) for p in pools[:1])
            + tuple(p.model_copy(update={"stream_idle_s": 30.0}) for p in pools[1:]),
        }
    )
    # Without retries a twin still bounds its tries (none retried), with what is set.
    for twin in [r for r in _all_routes(one) if r.name.startswith("stream-")]:
        retry = twin.route.retry_policy
        assert retry.num_retries.value == 0
        assert not retry.HasField("per_try_timeout")
        assert retry.per_try_idle_timeout.ToTimedelta().total_seconds() == 30
