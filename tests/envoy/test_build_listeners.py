from __future__ import annotations

import re
from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as accesslog_data_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from tests.envoy.static_bootstrap import hcm_of
from xds_server.config import RoutingConfig
from xds_server.envoy import build_listeners, names
from xds_server.envoy.listeners import (
    EARLY_REPLIES,
    GRPC_ACCESS_LOG,
    HCM_FILTER,
    HEADER_MUTATION_FILTER,
    JSON_CONTENT_TYPES,
    JSON_TO_METADATA_FILTER,
    LONG_PROMPT_LOG,
    PROMPT_KEY,
    PROMPT_NAMESPACE,
    ROUTER_FILTER,
    SESSION_KEY_LOG,
    STREAM_KEY,
)


def test_one_listener_on_the_configured_address(config: RoutingConfig) -> None:
    listener = build_listeners(config)[0]
    assert listener.name == names.LISTENER_NAME
    assert listener.address.socket_address.address == "127.0.0.1"
    assert listener.address.socket_address.port_value == 8080
    assert not listener.address.socket_address.ipv4_compat
    (chain,) = listener.filter_chains
    (network_filter,) = chain.filters
    assert network_filter.name == HCM_FILTER


def test_routes_come_from_rds_over_ads(config: RoutingConfig) -> None:
    hcm = hcm_of(build_listeners(config)[0])
    assert hcm.WhichOneof("route_specifier") == "rds"
    assert hcm.rds.route_config_name == names.ROUTE_CONFIG_NAME
    assert hcm.rds.config_source.HasField("ads")
    assert hcm.rds.config_source.resource_api_version == 2  # V3
    assert hcm.codec_type == hcm_pb2.HttpConnectionManager.AUTO
    assert hcm.stat_prefix == names.HCM_STAT_PREFIX
    assert hcm.stream_idle_timeout.seconds == 120


def test_filters_are_json_to_metadata_then_router(config: RoutingConfig) -> None:
    hcm = hcm_of(build_listeners(config)[0])
    assert [f.name for f in hcm.http_filters] == [JSON_TO_METADATA_FILTER, ROUTER_FILTER]
    assert hcm.http_filters[1].typed_config.Unpack(router_pb2.Router())


def _router(config: RoutingConfig) -> router_pb2.Router:
    hcm = hcm_of(build_listeners(config)[0])
    router = router_pb2.Router()
    assert hcm.http_filters[-1].name == ROUTER_FILTER
    assert hcm.http_filters[-1].typed_config.Unpack(router)
    return router


def _upstream_logs(router: router_pb2.Router) -> dict[str, tuple[Any, Any]]:
    """The router's upstream gRPC logs by log name: each with its config."""
    logs = {}
    for log in router.upstream_log:
        grpc_log = als_pb2.HttpGrpcAccessLogConfig()
        assert log.typed_config.Unpack(grpc_log)
        logs[grpc_log.common_config.log_name] = (log, grpc_log)
    return logs


def test_the_router_logs_long_prompts_upstream_streams_to_this_server(
    config: RoutingConfig,
) -> None:
    router = _router(config)
    assert router.upstream_log_options.flush_upstream_log_on_upstream_stream
    # And while it lasts: the first response bytes tell that its prefill is over.
    assert router.upstream_log_options.upstream_log_flush_interval.ToMilliseconds() == 100
    (log,) = router.upstream_log
    assert log.name == GRPC_ACCESS_LOG
    header = log.filter.header_filter.header
    assert header.name == "content-length"
    assert header.range_match.start == config.balancing.long_prompt_bytes
    grpc_log = als_pb2.HttpGrpcAccessLogConfig()
    assert log.typed_config.Unpack(grpc_log)
    common = grpc_log.common_config
    assert common.log_name == LONG_PROMPT_LOG
    assert common.grpc_service.envoy_grpc.cluster_name == names.XDS_CLUSTER
    assert common.transport_api_version == 2  # V3
    # Unbatched: a start reaches the server as soon as it is logged.
    assert common.HasField("buffer_size_bytes") and common.buffer_size_bytes.value == 0


def test_without_a_long_prompt_lane_the_router_logs_nothing(config: RoutingConfig) -> None:
    balancing = config.balancing.model_copy(update={"long_prompt_bytes": 0})
    router = _router(config.model_copy(update={"balancing": balancing}))
    assert router == router_pb2.Router()


def test_with_session_affinity_the_router_logs_each_keyed_upstream_stream_once_in_batches(
    affinity_config: RoutingConfig,
) -> None:
    router = _router(affinity_config)
    assert router.upstream_log_options.flush_upstream_log_on_upstream_stream
    log, grpc_log = _upstream_logs(router)[SESSION_KEY_LOG]
    keyed, ready = log.filter.and_filter.filters
    assert keyed.header_filter.header.name == names.SESSION_HEADER
    assert keyed.header_filter.header.present_match
    # Once per upstream stream: when it is established, not at its end nor periodically.
    assert list(ready.log_type_filter.types) == [accesslog_data_pb2.UpstreamPoolReady]
    assert list(grpc_log.additional_request_headers_to_log) == [names.SESSION_HEADER]
    common = grpc_log.common_config
    assert common.grpc_service.envoy_grpc.cluster_name == names.XDS_CLUSTER
    assert 0 < common.buffer_size_bytes.value <= 1024 * 1024
    assert common.buffer_flush_interval.ToMilliseconds() == 100
    # The interval is the config's.
    slower = affinity_config.balancing.model_copy(update={"key_log_flush_s": 0.5})
    router = _router(affinity_config.model_copy(update={"balancing": slower}))
    _, grpc_log = _upstream_logs(router)[SESSION_KEY_LOG]
    assert grpc_log.common_config.buffer_flush_interval.ToMilliseconds() == 500


def test_json_to_metadata_always_writes_a_model(config: RoutingConfig) -> None:
    hcm = hcm_of(build_listeners(config)[0])
    jtm = json_to_metadata_pb2.JsonToMetadata()
    assert hcm.http_filters[0].typed_config.Unpack(jtm)
    assert not jtm.HasField("response_rules")
    rule, stream = jtm.request_rules.rules
    assert [s.key for s in rule.selectors] == [names.MODEL_KEY]
    # `stream` as the JSON's boolean, for the streamed requests' routes (routes.py).
    assert [s.key for s in stream.selectors] == [STREAM_KEY]
    assert (stream.on_present.metadata_namespace, stream.on_present.key) == (
        names.METADATA_NAMESPACE,
        STREAM_KEY,
    )
    assert stream.on_present.type == json_to_metadata_pb2.JsonToMetadata.PROTOBUF_VALUE
    assert not stream.HasField("on_missing")
    for pair in (rule.on_present, rule.on_missing, rule.on_error):
        assert pair.metadata_namespace == names.METADATA_NAMESPACE
        assert pair.key == names.MODEL_KEY
        # PROTOBUF_VALUE keeps the JSON type: a number must not become a model name.
        assert pair.type == json_to_metadata_pb2.JsonToMetadata.PROTOBUF_VALUE
    assert not rule.on_present.HasField("value")
    assert rule.on_missing.value.string_value == names.MODEL_MISSING
    assert rule.on_error.value.string_value == names.MODEL_INVALID
    assert jtm.request_rules.allow_empty_content_type
    assert jtm.request_rules.allow_content_types_regex.regex == JSON_CONTENT_TYPES


def test_content_type_regex() -> None:
    # Envoy matches with RE2 against the whole value; Python's re agrees on these.
    for accepted in (
        "application/json",
        "application/json; charset=utf-8",
        "application/json;charset=UTF-8",
        "Application/JSON",
    ):
        assert re.fullmatch(JSON_CONTENT_TYPES, accepted), accepted
    for refused in ("text/plain", "application/jsonl", "multipart/form-data", "json"):
        assert not re.fullmatch(JSON_CONTENT_TYPES, refused), refused


def _mappers(config: RoutingConfig) -> tuple[Any, list[Any], Any, list[Any]]:
    """The local reply mappers in their groups: the 413, those by response flag, the one
    that keeps the routes' own bodies, and those of replies made before the filters (the
    retry budget's, first of all flagged ones, is checked on its own)."""
    too_large, budget, *rest = hcm_of(build_listeners(config)[0]).local_reply_config.mappers
    assert budget.body_format_override.json_format["error"]["code"] == "retry_budget_exhausted"
    count = next(i for i, m in enumerate(rest) if not m.filter.HasField("response_flag_filter"))
    return too_large, rest[:count], rest[count], rest[count + 1 :]


def test_a_retry_the_budget_refused_has_its_own_code_before_any_overflow(
    config: RoutingConfig,
) -> None:
    mappers = hcm_of(build_listeners(config)[0]).local_reply_config.mappers
    budget = mappers[1]
    both = [f.response_flag_filter.flags for f in budget.filter.and_filter.filters]
    assert both == [["UO"], ["UF", "UC", "UR", "URX", "LR"]]
    assert [(h.header.key, h.header.value) for h in budget.headers_to_add] == [
        ("retry-after", "1")
    ]
    # Before the mapper of a full circuit breaker, which a refused retry also matches.
    overflow = [i for i, m in enumerate(mappers) if "UO" in m.filter.response_flag_filter.flags]
    assert overflow and all(i > 1 for i in overflow)


def test_envoy_made_errors_are_json(config: RoutingConfig) -> None:
    too_large, flagged, _, _ = _mappers(config)
    assert too_large.filter.status_code_filter.comparison.value.default_value == 413
    error = too_large.body_format_override.json_format["error"]
    assert error["code"] == "request_too_large"
    assert "10485760 bytes" in error["message"]
    # Each cause its code, in first-match order; the last one catches any other flag.
    by_flags = {
        tuple(m.filter.response_flag_filter.flags): m.body_format_override.json_format["error"]
        for m in flagged
    }
    assert {flags: e["code"] for flags, e in by_flags.items()} == {
        ("UH",): "no_healthy_upstream",
        ("UO",): "overloaded",
        ("UF", "UC", "UR", "URX", "LR"): "upstream_unavailable",
        ("UT",): "upstream_timeout",
        ("NR",): "no_route",
        (): "gateway_error",
    }
    assert list(by_flags)[-1] == ()
    assert all(e["type"] == "server_error" for e in by_flags.values())
    waits = {
        tuple(m.filter.response_flag_filter.flags): [
            (h.header.key, h.header.value) for h in m.headers_to_add
        ]
        for m in flagged
    }
    for flags in (("UO",), ("UF", "UC", "UR", "URX", "LR")):
        assert waits[flags] == [("retry-after", "1")]
    assert waits[("UH",)] == waits[("UT",)] == waits[("NR",)] == []


def test_the_routes_direct_responses_keep_their_bodies(config: RoutingConfig) -> None:
    # Every route that answers itself matches once json_to_metadata wrote `llm:model`
    # (routes.py): a mapper on that, without overrides, stops the ones after it.
    _, _, keep, _ = _mappers(config)
    metadata = keep.filter.metadata_filter
    assert metadata.matcher.filter == names.METADATA_NAMESPACE
    assert [p.key for p in metadata.matcher.path] == [names.MODEL_KEY]
    assert metadata.matcher.value.present_match
    assert metadata.HasField("match_if_key_not_found")
    assert not metadata.match_if_key_not_found.value
    for override in ("status_code", "body", "body_format_override"):
        assert not keep.HasField(override), override
    assert not keep.headers_to_add


def test_replies_made_before_the_filters_are_json_by_status(config: RoutingConfig) -> None:
    _, _, _, early = _mappers(config)
    *by_status, anything = early
    codes = {
        m.filter.status_code_filter.comparison.value.default_value: (
            m.body_format_override.json_format["error"]
        )
        for m in by_status
    }
    assert {status: e["code"] for status, e in codes.items()} == {
        status: code for status, (code, _) in EARLY_REPLIES.items()
    }
    assert set(EARLY_REPLIES) >= {400, 404, 426, 431}
    assert all(
        m.filter.status_code_filter.comparison.op == accesslog_pb2.ComparisonFilter.EQ
        for m in by_status
    )
    for status, error in codes.items():
        assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
        assert error["param"] is None
        assert "%RESPONSE_CODE_DETAILS%" in error["message"]
    assert not [m for m in by_status if m.HasField("status_code")]
    # Any other status keeps its status and says Envoy's reason.
    comparison = anything.filter.status_code_filter.comparison
    assert (comparison.op, comparison.value.default_value) == (
        accesslog_pb2.ComparisonFilter.GE,
        0,
    )
    error = anything.body_format_override.json_format["error"]
    assert (error["code"], error["message"]) == ("gateway_error", "%RESPONSE_CODE_DETAILS%")


def test_ipv6_any_address_accepts_ipv4(config: RoutingConfig) -> None:
    listener_config = config.listener.model_copy(update={"address": "::"})
    listener = build_listeners(config.model_copy(update={"listener": listener_config}))[0]
    assert listener.address.socket_address.ipv4_compat


def test_building_is_deterministic(config: RoutingConfig) -> None:
    first = build_listeners(config)[0].SerializeToString(deterministic=True)
    second = build_listeners(config)[0].SerializeToString(deterministic=True)
    assert first == second


def test_session_affinity_adds_the_session_key_and_header_mutation(
    affinity_config: RoutingConfig,
) -> None:
    hcm = hcm_of(build_listeners(affinity_config)[0])
    assert [f.name for f in hcm.http_filters] == [
        JSON_TO_METADATA_FILTER,
        HEADER_MUTATION_FILTER,
        ROUTER_FILTER,
    ]
    # No mutations of its own: the session routes configure it (test_build_routes.py).
    mutation = header_mutation_pb2.HeaderMutation()
    assert hcm.http_filters[1].typed_config.Unpack(mutation)
    assert mutation == header_mutation_pb2.HeaderMutation()
    jtm = json_to_metadata_pb2.JsonToMetadata()
    assert hcm.http_filters[0].typed_config.Unpack(jtm)
    model_rule, *session_rules, stream_rule = jtm.request_rules.rules
    assert [s.key for s in model_rule.selectors] == [names.MODEL_KEY]
    assert [s.key for s in stream_rule.selectors] == [STREAM_KEY]
    # A later write to the same key wins: `user` first, so `prompt_cache_key` wins.
    assert [[s.key for s in r.selectors] for r in session_rules] == [["user"], ["prompt_cache_key"]]
    assert names.SESSION_BODY_KEYS == ("prompt_cache_key", "user")
    for rule in session_rules:
        assert rule.on_present.metadata_namespace == names.METADATA_NAMESPACE
        assert rule.on_present.key == names.SESSION_KEY
        # Strings: a numeric `user` becomes its digits and an empty one writes nothing.
        assert rule.on_present.type == json_to_metadata_pb2.JsonToMetadata.STRING
        assert not rule.on_present.HasField("value")
        assert not rule.HasField("on_missing") and not rule.HasField("on_error")


def _with_prefix_keys(config: RoutingConfig, prefix_bytes: int) -> RoutingConfig:
    balancing = config.balancing.model_copy(update={"prefix_key_bytes": prefix_bytes})
    return config.model_copy(update={"balancing": balancing})


def test_prefix_keys_read_the_prompt_into_its_own_namespace(
    affinity_config: RoutingConfig,
) -> None:
    hcm = hcm_of(build_listeners(_with_prefix_keys(affinity_config, 64))[0])
    jtm = json_to_metadata_pb2.JsonToMetadata()
    assert hcm.http_filters[0].typed_config.Unpack(jtm)
    *_, prompt_rule, _stream = jtm.request_rules.rules
    assert [s.key for s in prompt_rule.selectors] == [PROMPT_KEY] == ["prompt"]
    # Alone in its namespace: the routes print the namespace whole, as JSON.
    assert prompt_rule.on_present.metadata_namespace == PROMPT_NAMESPACE != names.METADATA_NAMESPACE
    assert prompt_rule.on_present.key == PROMPT_KEY
    assert prompt_rule.on_present.type == json_to_metadata_pb2.JsonToMetadata.STRING
    assert not prompt_rule.HasField("on_missing") and not prompt_rule.HasField("on_error")


def test_prefix_keys_are_off_by_default_and_without_session_affinity(
    affinity_config: RoutingConfig,
) -> None:
    def selectors(config: RoutingConfig) -> list[list[str]]:
        jtm = json_to_metadata_pb2.JsonToMetadata()
        assert hcm_of(build_listeners(config)[0]).http_filters[0].typed_config.Unpack(jtm)
        return [[s.key for s in r.selectors] for r in jtm.request_rules.rules]

    assert affinity_config.balancing.prefix_key_bytes == 0
    assert ["prompt"] not in selectors(affinity_config)
    pools = tuple(p.model_copy(update={"session_affinity": False}) for p in affinity_config.pools)
    no_affinity = affinity_config.model_copy(update={"pools": pools})
    assert selectors(_with_prefix_keys(no_affinity, 64)) == [[names.MODEL_KEY], [STREAM_KEY]]


def test_without_session_affinity_the_filters_stay_as_they_were(
    affinity_config: RoutingConfig,
) -> None:
    pools = tuple(p.model_copy(update={"session_affinity": False}) for p in affinity_config.pools)
    hcm = hcm_of(build_listeners(affinity_config.model_copy(update={"pools": pools}))[0])
    assert [f.name for f in hcm.http_filters] == [JSON_TO_METADATA_FILTER, ROUTER_FILTER]


def test_flow_control_maps_a_full_band_to_429_with_retry_after(config: RoutingConfig) -> None:
    from google.protobuf import json_format

    plain = hcm_of(build_listeners(config)[0]).local_reply_config
    flow = config.flow_control.model_copy(update={"enabled": True})
    banded = hcm_of(
        build_listeners(config.model_copy(update={"flow_control": flow}))[0]
    ).local_reply_config
    # The band's 429 takes the place of the pool's 503 `overloaded`; the others stay.
    assert len(banded.mappers) == len(plain.mappers)
    for with_bands, without in zip(banded.mappers, plain.mappers, strict=True):
        if list(without.filter.response_flag_filter.flags) != ["UO"]:
            assert with_bands == without
    (full,) = [m for m in banded.mappers if list(m.filter.response_flag_filter.flags) == ["UO"]]
    assert list(full.filter.response_flag_filter.flags) == ["UO"]
    assert full.status_code.value == 429
    (header,) = full.headers_to_add
    assert header.header.key == "retry-after"
    assert header.header.value == "%METADATA(ROUTE:llm:retry_after_s)%"
    error = json_format.MessageToDict(full.body_format_override.json_format)["error"]
    assert error == {
        "message": (
            "The %METADATA(ROUTE:llm:band)% band of pool %METADATA(ROUTE:llm:pool)% is full; "
            "retry after %METADATA(ROUTE:llm:retry_after_s)% s."
        ),
        "type": names.RATE_LIMIT_ERROR_TYPE,
        "param": None,
        "code": "rate_limit_exceeded",
    }


def test_a_session_pool_gets_an_internal_spill_listener(affinity_config: RoutingConfig) -> None:
    main, spill = build_listeners(affinity_config)
    assert main.name == names.LISTENER_NAME
    assert spill.name == names.spill_listener_name("llm")
    assert spill.HasField("internal_listener")
    assert not spill.HasField("address")
    hcm = hcm_of(spill)
    assert hcm.rds.route_config_name == names.spill_listener_name("llm")
    assert hcm.rds.config_source.HasField("ads")
    # It only forwards: the request was read and routed by the listener.
    assert [f.name for f in hcm.http_filters] == [ROUTER_FILTER]
    assert hcm.local_reply_config == hcm_of(main).local_reply_config
    balancing = affinity_config.balancing.model_copy(update={"spill_to": "ring"})
    assert len(build_listeners(affinity_config.model_copy(update={"balancing": balancing}))) == 1
