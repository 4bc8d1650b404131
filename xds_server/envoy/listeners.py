"""The listener that accepts OpenAI-style traffic.

One listener, one HTTP connection manager (HCM), and its HTTP filters:

1. `envoy.filters.http.json_to_metadata` reads the request body's `model` into dynamic
   metadata `llm:model`, which the routes match (routes.py). It buffers the body, which
   is why the route config raises the body buffer limit. It clears the route cache only
   when it writes a key, so `on_missing` and `on_error` always write a sentinel
   (names.MODEL_MISSING, names.MODEL_INVALID): otherwise a request without `model`
   would keep the route picked from its headers alone. When a pool has session affinity
   it also writes the body's session key into `llm:session_key`: `prompt_cache_key`, or
   `user` when there is no `prompt_cache_key` (rules run in order and a later write to the
   same key wins, so `user` comes first). As strings (a number becomes its digits); an
   empty string, an object or a value over Envoy's 8 KiB limit writes nothing.
   With `balancing.prefix_key_bytes` above 0 it also writes the body's `prompt` (the
   completions API's, a string) into PROMPT_NAMESPACE, a namespace of its own: the routes
   print that namespace as JSON and cut it to the prefix (routes.py). Verified on Envoy
   1.40: the limit is 8,192 bytes of the decoded string (UTF-8), and a longer prompt
   writes nothing (json_to_metadata cannot cut a value: the rule fails as if the key were
   missing); a list or an object writes nothing either, and a selector is a path of
   object keys only, so a chat's `messages[0].content` (in an array) is out of reach.
2. Only with session affinity: `envoy.filters.http.header_mutation`, with no mutations of
   its own. The session routes give it one each (per-route config) that writes the body's
   session key, or the prompt's prefix, into names.SESSION_HEADER for their hash policy
   (routes.py).
3. Only when a pool keeps its keys in buckets (`balancing.key_homes` "buckets"): the
   composite filter of _key_buckets.py, which writes the session header's bucket into the
   request's `envoy.lb` dynamic metadata for the bucketed session clusters' subsets.
4. `envoy.filters.http.router` forwards; responses are never buffered (no buffer or
   compressor filter), so server-sent events reach the client chunk by chunk. When a pool
   has a long-prompt lane (config.lanes), its upstream log sends the upstream streams of
   requests with a `content-length` of at least `balancing.long_prompt_bytes` to this
   server over gRPC (ALS, log LONG_PROMPT_LOG, unbatched): when the stream to the pod is
   established (`flush_upstream_log_on_upstream_stream`), every LONG_PROMPT_LOG_INTERVAL_S
   while it lasts, and when it ends. The policy learns from it which pod just took a long
   prompt, and when its prefill is over (xds/access_logs.py). When a pool has session
   affinity, a second upstream log sends the upstream stream of each request that carries
   names.SESSION_HEADER, once, when it is established (UpstreamPoolReady: not its end, nor
   the periodic flushes of long prompts), with that header, in batches every
   `balancing.key_log_flush_s` (log SESSION_KEY_LOG): the server keeps the key's hash and
   the pod (xds/session_keys.py).

Each request is logged as one JSON line (access_log.py, `listener.access_log`).

Every reply Envoy makes itself gets an OpenAI-style JSON body (`local_reply_config`) with a
stable `code`: 413 `request_too_large` for a body over the limit; 503
`no_healthy_upstream` when a pool has no healthy endpoint (response flag UH: no ready pod);
with flow control, 429 `rate_limit_exceeded` when a band cluster's circuit breaker refuses
a request (flag UO: it never reached a model server), else 503 `overloaded` for the pool
cluster's own circuit breaker; 503 `upstream_unavailable` when the pod failed before
answering and retries could not save the request (UF, UC, UR, URX, LR), and
`retry_budget_exhausted` when a retry was not made because the cluster's retry budget was
spent (Envoy flags that UO beside the failure: without its own mapper it would read as a
full circuit breaker); 504
`upstream_timeout` (UT); 404 `no_route` (NR); and `gateway_error`, with Envoy's own words
and status, for any other flagged reply. `upstream_unavailable`, `retry_budget_exhausted` and
`overloaded` say `retry-after: 1`. A tenant over its request rate (_tenant_limits.py) gets
429 `tenant_rate_limit_exceeded` naming it and its limit (`_tenant_limited`); a weighted
tenant whose lane (its fair share of the band) is full gets 429 `tenant_share_exceeded`
naming it, the band and the pool (`_tenant_share_full`). The band's 429 carries
`retry-after` and a message naming the band and the pool, both read from the matched
route's metadata (`%METADATA(ROUTE:llm:retry_after_s)%`, routes.py): verified on Envoy 1.40,
so Retry-After follows the policy through RDS without a listener update (which would drain
connections).

The routes' own direct responses (the model list, the 404 of a path not served, the 405s,
the refusals of a model: routes.py) keep the bodies the routes give them. Every route that
answers itself matches only once json_to_metadata wrote `llm:model`, and a mapper on that
key, with nothing to override, comes before the mappers by status: the first match wins.

What remains is refused before the filters read the request, and gets a JSON body by
status (EARLY_REPLIES), Envoy's reason (`%RESPONSE_CODE_DETAILS%`) in its message: the
HTTP/1 codec's 400 (not HTTP, an unknown method), 431 (headers over
`listener.max_request_headers_kb`, 32 KiB, or over 100 of them), 426 (HTTP/1.0) and 501 (a
transfer-encoding other than chunked); the connection manager's 400 (no Host, a fragment
in the path), 403 (an Upgrade: none is configured) and 404 (`*` as the request target);
any other status `gateway_error`. Verified on Envoy 1.40 (raw requests,
tests/e2e/test_closed_path.py). The codec's replies carry the flag DPE in the access log,
but it is set after the mappers ran: matching them by flag finds nothing. Out of reach:
over HTTP/2 the same limits send no response at all (Envoy 1.40 closed the connection on
a 70 KB header and reset the stream, INTERNAL_ERROR, on 150 headers), so there is no
body to make JSON.

Routes come over RDS on the ADS stream, so a route change never touches the listener
(a listener update drains its connections).
"""

from __future__ import annotations

from typing import Any as _Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    grpc_service_pb2,
    protocol_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as accesslog_data_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2 as grpc_als_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, value_pb2
from envoy.type.v3 import range_pb2
from google.protobuf import struct_pb2, wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.config import PoolConfig, RoutingConfig, TenantsConfig
from xds_server.envoy import _error_bodies, _key_buckets, _protos, _tenant_limits, names
from xds_server.envoy.access_log import request_log

__all__ = [
    "EARLY_REPLIES",
    "GRPC_ACCESS_LOG",
    "HCM_FILTER",
    "HEADER_MUTATION_FILTER",
    "JSON_CONTENT_TYPES",
    "JSON_TO_METADATA_FILTER",
    "LONG_PROMPT_LOG",
    "LONG_PROMPT_LOG_INTERVAL_S",
    "PROMPT_KEY",
    "PROMPT_NAMESPACE",
    "RETRY_AFTER_HEADER",
    "ROUTER_FILTER",
    "SESSION_KEY_LOG",
    "SESSION_KEY_LOG_BUFFER_BYTES",
    "STREAM_KEY",
    "UNAVAILABLE_RETRY_AFTER_S",
    "bounds_streams",
    "build_http_connection_manager",
    "build_listeners",
]

HCM_FILTER = "envoy.filters.network.http_connection_manager"
JSON_TO_METADATA_FILTER = "envoy.filters.http.json_to_metadata"
# Present only when a pool has session affinity; the session routes configure it.
HEADER_MUTATION_FILTER = "envoy.filters.http.header_mutation"
ROUTER_FILTER = "envoy.filters.http.router"
# The body's `prompt` when prompt-prefix keys are on, alone in its namespace: the routes
# print the whole namespace, `{"prompt":"<the prompt, JSON-escaped>"}` (routes.py).
PROMPT_NAMESPACE = "llm.prompt"
PROMPT_KEY = "prompt"
# The body's `stream`, as json_to_metadata writes it (`llm:stream`).
STREAM_KEY = "stream"
# The router's upstream log of long prompts: Envoy's gRPC access logger, its log name, and
# how often a long prompt's stream is logged while it lasts (the end of its prefill is known
# that much later; xds/access_logs.py reads the entries).
GRPC_ACCESS_LOG = "envoy.access_loggers.http_grpc"
LONG_PROMPT_LOG = "long_prompts"
LONG_PROMPT_LOG_INTERVAL_S = 0.1
# The router's upstream log of keyed requests, batched: the session header of each request's
# upstream stream, once, when the stream to the pod is established (xds/session_keys.py).
# Envoy sends a batch every `balancing.key_log_flush_s`, or sooner once it holds
# SESSION_KEY_LOG_BUFFER_BYTES.
SESSION_KEY_LOG = "session_keys"
SESSION_KEY_LOG_BUFFER_BYTES = 64 * 1024

# Set on the 429 of a full band (RFC 9110 10.2.3: delay in seconds), and on the 503s of a
# pod that failed or a full pool cluster, where waiting a moment helps: the retries have
# already tried other pods, and the server takes a failed pod out within a scrape interval.
RETRY_AFTER_HEADER = "retry-after"
UNAVAILABLE_RETRY_AFTER_S = 1
# Response flags of a pod that failed before answering: connect failure, connection
# termination, reset, retry limit exceeded, local reset.
UPSTREAM_FAILURE_FLAGS = ("UF", "UC", "UR", "URX", "LR")

# Envoy's reason for a reply it made itself (`http1.headers_too_large`, ...).
_DETAILS = "%RESPONSE_CODE_DETAILS%"

# The replies Envoy makes before its filters read a request, by status: their `code`
# and message (module docstring). Any other status gets `gateway_error`.
EARLY_REPLIES: dict[int, tuple[str, str]] = {
    400: ("bad_request", f"The request is not valid HTTP ({_DETAILS})."),
    403: ("forbidden", f"The gateway serves no protocol upgrade such as WebSocket ({_DETAILS})."),
    404: ("not_found", f"No resource is served at this request target ({_DETAILS})."),
    426: ("upgrade_required", f"Use HTTP/1.1 or HTTP/2 ({_DETAILS})."),
    431: (
        "request_header_fields_too_large",
        f"The request headers are too large or too many ({_DETAILS}).",
    ),
    501: ("not_implemented", f"The request's framing is not supported ({_DETAILS})."),
}

# RE2, matched against the whole content-type. Without it json_to_metadata accepts only
# the exact string `application/json` and treats `application/json; charset=utf-8` as an
# error. Media types are case-insensitive (RFC 9110 8.3.1).
JSON_CONTENT_TYPES = r"(?i)application/json\s*(;.*)?"


def build_listeners(config: RoutingConfig) -> list[_Any]:
    """The listeners for `config`: names.LISTENER_NAME, then the spill listener of each pool
    whose spilling pods send their keys there (`_spill_listener`), in config order."""
    listen = config.listener
    socket = address_pb2.SocketAddress(
        address=listen.address,
        port_value=listen.port,
        # "::" accepts IPv4 clients too, as "0.0.0.0" users expect.
        ipv4_compat=listen.address == "::",
    )
    hcm = build_http_connection_manager(config)
    return [
        listener_pb2.Listener(
            name=names.LISTENER_NAME,
            address=address_pb2.Address(socket_address=socket),
            filter_chains=[
                listener_components_pb2.FilterChain(
                    filters=[
                        listener_components_pb2.Filter(
                            name=HCM_FILTER, typed_config=_protos.pack(hcm)
                        )
                    ]
                )
            ],
        ),
        *(_spill_listener(config, pool.name) for pool in config.pools if config.spills(pool)),
    ]


def _spill_listener(config: RoutingConfig, pool: str) -> _Any:
    """`pool`'s internal listener (Envoy's `envoy.bootstrap.internal_listener`, no socket):
    the address of a spilling pod in the session assignment (endpoints.py). Its routes
    (RDS, routes.build_spill_routes) send each request on to the pool's cluster, balanced
    by the load-following weights, on which the spilling pod is DEGRADED. The request was
    read, routed and admitted by the listener; this one only forwards, with its own
    replies made JSON the same way."""
    name = names.spill_listener_name(pool)
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix=f"{names.HCM_STAT_PREFIX}_spill_{pool}",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=_rds(name),
        stream_idle_timeout=_protos.duration(config.listener.stream_idle_timeout_s),
        http_filters=[
            hcm_pb2.HttpFilter(name=ROUTER_FILTER, typed_config=_protos.pack(router_pb2.Router()))
        ],
        local_reply_config=_local_replies(config),
    )
    return listener_pb2.Listener(
        name=name,
        internal_listener=listener_pb2.Listener.InternalListenerConfig(),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(name=HCM_FILTER, typed_config=_protos.pack(hcm))
                ]
            )
        ],
    )


def _rds(route_config_name: str) -> _Any:
    return hcm_pb2.Rds(
        config_source=config_source_pb2.ConfigSource(
            ads=config_source_pb2.AggregatedConfigSource(),
            resource_api_version=config_source_pb2.V3,
        ),
        route_config_name=route_config_name,
    )


def build_http_connection_manager(config: RoutingConfig) -> _Any:
    """The HCM of the listener, with routes from RDS over ADS (names.ROUTE_CONFIG_NAME)."""
    listen = config.listener
    return hcm_pb2.HttpConnectionManager(
        stat_prefix=names.HCM_STAT_PREFIX,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=_rds(names.ROUTE_CONFIG_NAME),
        # The request-wide timeout is per route (routes.py); this one only resets streams
        # that go quiet in both directions, so a long generation that streams survives.
        stream_idle_timeout=_protos.duration(listen.stream_idle_timeout_s),
        # Bounds on clients: a slowloris, oversized headers, idle connections.
        request_headers_timeout=_protos.duration(listen.request_headers_timeout_s),
        max_request_headers_kb=wrappers_pb2.UInt32Value(value=listen.max_request_headers_kb),
        common_http_protocol_options=protocol_pb2.HttpProtocolOptions(
            idle_timeout=_protos.duration(listen.idle_timeout_s)
        ),
        http_filters=_http_filters(
            sessions=any(p.session_affinity for p in config.pools),
            key_log_flush_s=config.balancing.key_log_flush_s,
            prompts=any(p.session_affinity for p in config.pools)
            and config.balancing.prefix_key_bytes > 0,
            long_prompt_bytes=config.balancing.long_prompt_bytes
            if any("long" in config.lanes(p) for p in config.pools)
            else None,
            streams=any(bounds_streams(p) for p in config.pools),
            tenants=config.flow_control.tenants,
            key_buckets=config.balancing.key_buckets
            if any(config.bucket_homes(p) for p in config.pools)
            else None,
        ),
        local_reply_config=_local_replies(config),
        # One JSON line per request (access_log.py); the spill listener's hop is not
        # logged again.
        access_log=[
            request_log(
                listen.access_log, _tenant_limits.tenant_format(config.flow_control.tenants)
            )
        ]
        if listen.access_log.enabled
        else [],
    )


def bounds_streams(pool: PoolConfig) -> bool:
    """Whether `pool`'s streamed requests have bounds of their own (routes.py)."""
    return pool.first_byte_s > 0 or pool.stream_idle_s > 0


def _http_filters(
    *,
    sessions: bool,
    key_log_flush_s: float,
    prompts: bool,
    long_prompt_bytes: int | None,
    streams: bool,
    tenants: TenantsConfig | None = None,
    key_buckets: int | None = None,
) -> list[_Any]:
    tenants = tenants or TenantsConfig()
    rate_limit = hcm_pb2.HttpFilter(
        name=_tenant_limits.LOCAL_RATE_LIMIT_FILTER,
        typed_config=_protos.pack(_tenant_limits.listener_filter()),
    )
    # The tenants' rate limit first when a header names them (a refused request's body is
    # never buffered), else after json_to_metadata has read the body's tenant.
    filters = [rate_limit] if tenants.header is not None else []
    filters.append(
        hcm_pb2.HttpFilter(
            name=JSON_TO_METADATA_FILTER,
            typed_config=_protos.pack(
                _json_to_metadata(
                    sessions, prompts=prompts, streams=streams, tenant=tenants.body_field
                )
            ),
        )
    )
    if tenants.body_field is not None:
        filters.append(rate_limit)
    if sessions:
        filters.append(
            hcm_pb2.HttpFilter(
                name=HEADER_MUTATION_FILTER,
                # Mutations come per route, on the session routes only (routes.py).
                typed_config=_protos.pack(header_mutation_pb2.HeaderMutation()),
            )
        )
    if key_buckets is not None:
        # After the session routes wrote the session header, before the router reads the
        # subset criteria.
        filters.append(_key_buckets.key_bucket_filter(key_buckets))
    router = router_pb2.Router()
    if long_prompt_bytes is not None:
        router.upstream_log.append(_long_prompt_log(long_prompt_bytes))
        router.upstream_log_options.upstream_log_flush_interval.CopyFrom(
            _protos.duration(LONG_PROMPT_LOG_INTERVAL_S)
        )
    if sessions:
        router.upstream_log.append(_session_key_log(key_log_flush_s))
    if long_prompt_bytes is not None or sessions:
        router.upstream_log_options.flush_upstream_log_on_upstream_stream = True
    filters.append(hcm_pb2.HttpFilter(name=ROUTER_FILTER, typed_config=_protos.pack(router)))
    return filters


def _to_server(log_name: str, buffer_size_bytes: int) -> _Any:
    """Envoy's gRPC access logger's settings for log `log_name` to this server (ALS)."""
    return grpc_als_pb2.CommonGrpcAccessLogConfig(
        log_name=log_name,
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=names.XDS_CLUSTER)
        ),
        transport_api_version=config_source_pb2.V3,
        buffer_size_bytes=wrappers_pb2.UInt32Value(value=buffer_size_bytes),
    )


def _long_prompt_log(long_prompt_bytes: int) -> _Any:
    """The upstream log of long prompts, to this server over gRPC, one entry at a time."""
    # 0 turns batching off: each entry is sent as it is logged.
    config = grpc_als_pb2.HttpGrpcAccessLogConfig(common_config=_to_server(LONG_PROMPT_LOG, 0))
    return accesslog_pb2.AccessLog(
        name=GRPC_ACCESS_LOG,
        filter=accesslog_pb2.AccessLogFilter(
            header_filter=accesslog_pb2.HeaderFilter(
                header=route_components_pb2.HeaderMatcher(
                    name="content-length",
                    range_match=range_pb2.Int64Range(start=long_prompt_bytes, end=2**63 - 1),
                )
            )
        ),
        typed_config=_protos.pack(config),
    )


def _session_key_log(flush_s: float) -> _Any:
    """The upstream log of keyed requests, to this server over gRPC, in batches every
    `flush_s`: one entry per upstream stream that carries names.SESSION_HEADER, when the
    stream to the pod is established (UpstreamPoolReady; its end and the periodic flushes
    of long prompts are left out), with the header's value."""
    common = _to_server(SESSION_KEY_LOG, SESSION_KEY_LOG_BUFFER_BYTES)
    common.buffer_flush_interval.CopyFrom(_protos.duration(flush_s))
    config = grpc_als_pb2.HttpGrpcAccessLogConfig(
        common_config=common, additional_request_headers_to_log=[names.SESSION_HEADER]
    )
    keyed = accesslog_pb2.AccessLogFilter(
        header_filter=accesslog_pb2.HeaderFilter(
            header=route_components_pb2.HeaderMatcher(name=names.SESSION_HEADER, present_match=True)
        )
    )
    ready = accesslog_pb2.AccessLogFilter(
        log_type_filter=accesslog_pb2.LogTypeFilter(types=[accesslog_data_pb2.UpstreamPoolReady])
    )
    return accesslog_pb2.AccessLog(
        name=GRPC_ACCESS_LOG,
        filter=accesslog_pb2.AccessLogFilter(
            and_filter=accesslog_pb2.AndFilter(filters=[keyed, ready])
        ),
        typed_config=_protos.pack(config),
    )


def _json_to_metadata(
    sessions: bool, *, prompts: bool = False, streams: bool = False, tenant: str | None = None
) -> _Any:
    jtm = json_to_metadata_pb2.JsonToMetadata

    def write(key: str, value: str | None = None) -> _Any:
        # PROTOBUF_VALUE (the default type) keeps the JSON type of `model`, so a number or
        # a boolean is not silently turned into a string that could name a model.
        pair = jtm.KeyValuePair(metadata_namespace=names.METADATA_NAMESPACE, key=key)
        if value is not None:
            pair.value.CopyFrom(struct_pb2.Value(string_value=value))
        return pair

    rules = [
        jtm.Rule(
            selectors=[jtm.Selector(key=names.MODEL_KEY)],
            on_present=write(names.MODEL_KEY),
            on_missing=write(names.MODEL_KEY, names.MODEL_MISSING),
            on_error=write(names.MODEL_KEY, names.MODEL_INVALID),
        )
    ]

    def as_string(field: str, namespace: str, key: str) -> _Any:
        # Written only when present (no on_missing), as a string: an empty one writes
        # nothing.
        pair = jtm.KeyValuePair(metadata_namespace=namespace, key=key, type=jtm.STRING)
        return jtm.Rule(selectors=[jtm.Selector(key=field)], on_present=pair)

    if sessions:
        # The session routes match on it.
        rules += [
            as_string(field, names.METADATA_NAMESPACE, names.SESSION_KEY)
            for field in reversed(names.SESSION_BODY_KEYS)
        ]
    if prompts:
        # An empty prompt writes nothing (no key to hash).
        rules.append(as_string(PROMPT_KEY, PROMPT_NAMESPACE, PROMPT_KEY))
    if streams:
        # `llm:stream`, as the JSON's boolean (routes.py: streamed requests' bounds).
        rules.append(
            jtm.Rule(selectors=[jtm.Selector(key=STREAM_KEY)], on_present=write(STREAM_KEY))
        )
    if tenant is not None:
        # `llm:tenant`: the tenants' rate limit.
        rules.append(as_string(tenant, names.METADATA_NAMESPACE, _tenant_limits.TENANT_KEY))
    return jtm(
        request_rules=jtm.MatchRules(
            rules=rules,
            allow_content_types_regex=regex_pb2.RegexMatcher(regex=JSON_CONTENT_TYPES),
            # A request without a body usually has no content-type: let it count as "no
            # model", so the model header can still route it (and GET /v1/models is
            # answered: every route waits for `llm:model`, routes.py).
            allow_empty_content_type=True,
        )
    )


def _local_replies(config: RoutingConfig) -> _Any:
    """Every reply Envoy makes itself as OpenAI-style JSON, with a stable `code` per cause
    (module docstring). Mappers are tried in order and the first that matches wins; the
    routes' own direct responses carry no response flag and keep their bodies."""
    too_large = _error_bodies.error_format(
        message=(
            f"The request body is larger than the gateway's limit of "
            f"{config.listener.max_request_bytes} bytes."
        ),
        code="request_too_large",
        param=None,
    )
    mappers = [
        # The body is over the route's buffer limit (json_to_metadata buffers it).
        hcm_pb2.ResponseMapper(filter=_status_filter(413), body_format_override=too_large),
        # Before every UO mapper: a retry the budget refused sets UO beside the failure.
        _retry_budget_spent(),
        # The pool has no endpoint, or none healthy: no ready pod. No Retry-After: nothing
        # says one will be ready soon (it takes a new pod, or a stale one coming back).
        _flagged(
            ["UH"],
            code="no_healthy_upstream",
            message="No healthy endpoint is available for the requested model; retry later.",
        ),
    ]
    tenants = config.flow_control.tenants
    mappers += [
        _tenant_limited(tenants, tenant, rate) for tenant, rate in tenants.rate_limited().items()
    ]
    if config.flow_control.enabled:
        mappers += [_tenant_share_full(tenants, tenant) for tenant in tenants.weighted()]
        mappers.append(_band_full())
    else:
        # The pool cluster's circuit breaker (config.upstream.max_requests) is full.
        mappers.append(
            _flagged(
                ["UO"],
                code="overloaded",
                message="The gateway has too many requests in flight for this model; retry later.",
                retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
            )
        )
    mappers += [
        # The pod could not be reached or dropped the request before answering, and the
        # retries on other pods (routes.py) failed too or were not allowed.
        _flagged(
            list(UPSTREAM_FAILURE_FLAGS),
            code="upstream_unavailable",
            message="The model server failed before answering: %LOCAL_REPLY_BODY%",
            retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
        ),
        _flagged(
            ["UT"],
            code="upstream_timeout",
            message="The model server did not answer within the gateway's request timeout.",
        ),
        _flagged(["NR"], code="no_route", message="No route serves this request."),
        # Anything else Envoy refuses itself keeps its status and says why.
        _flagged([], code="gateway_error", message="%LOCAL_REPLY_BODY%"),
        # The routes' own direct responses (routes.py) keep their bodies: json_to_metadata
        # has written `llm:model` for every request a route answers. A mapper without
        # overrides changes nothing, and the first match wins.
        hcm_pb2.ResponseMapper(filter=_model_read()),
    ]
    # What is left is refused before the filters read the request: by the codec (its
    # flag DPE is set only after the mappers ran, so these are told by status) or by the
    # connection manager (no Host, a fragment, an Upgrade, `*` as the path).
    mappers += [
        _early(status, code=code, message=message)
        for status, (code, message) in sorted(EARLY_REPLIES.items())
    ]
    mappers.append(_early(None, code="gateway_error", message=_DETAILS))
    return hcm_pb2.LocalReplyConfig(mappers=mappers)


def _model_read() -> _Any:
    """The local replies to requests json_to_metadata has read (`llm:model` is set)."""
    return accesslog_pb2.AccessLogFilter(
        metadata_filter=accesslog_pb2.MetadataFilter(
            matcher=metadata_pb2.MetadataMatcher(
                filter=names.METADATA_NAMESPACE,
                path=[metadata_pb2.MetadataMatcher.PathSegment(key=names.MODEL_KEY)],
                value=value_pb2.ValueMatcher(present_match=True),
            ),
            match_if_key_not_found=wrappers_pb2.BoolValue(value=False),
        )
    )


def _early(status: int | None, *, code: str, message: str) -> _Any:
    """A mapper for the replies of `status` (any when None) made before the filters ran:
    the status kept, a JSON body with `code`."""
    error_type = names.ERROR_TYPE if status is not None and status < 500 else "server_error"
    body = _error_bodies.error_format(message=message, code=code, param=None, error_type=error_type)
    if status is None:
        any_status = accesslog_pb2.AccessLogFilter(
            status_code_filter=_status_comparison(accesslog_pb2.ComparisonFilter.GE, 0)
        )
        return hcm_pb2.ResponseMapper(filter=any_status, body_format_override=body)
    return hcm_pb2.ResponseMapper(filter=_status_filter(status), body_format_override=body)


def _flagged(
    flags: list[str], *, code: str, message: str, retry_after_s: int | None = None
) -> _Any:
    """A mapper for the local replies with one of `flags` (any flag when empty): a JSON
    body with `code`, and `retry-after` when waiting helps."""
    mapper = hcm_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(
            response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=flags)
        ),
        body_format_override=_error_bodies.error_format(
            message=message, code=code, param=None, error_type="server_error"
        ),
    )
    if retry_after_s is not None:
        mapper.headers_to_add.append(_retry_after(str(retry_after_s)))
    return mapper


def _retry_budget_spent() -> _Any:
    """503 `retry_budget_exhausted` for a request whose pod failed before answering and
    whose retry the cluster's retry budget refused (config.upstream). Envoy flags that
    reply UO (overflow) beside the failure's own flag, so without this mapper it read as
    a full circuit breaker: 503 `overloaded`, or with flow control a band's 429."""
    flags = accesslog_pb2.AccessLogFilter
    mapper = hcm_pb2.ResponseMapper(
        filter=flags(
            and_filter=accesslog_pb2.AndFilter(
                filters=[
                    flags(response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=["UO"])),
                    flags(
                        response_flag_filter=accesslog_pb2.ResponseFlagFilter(
                            flags=list(UPSTREAM_FAILURE_FLAGS)
                        )
                    ),
                ]
            )
        ),
        body_format_override=_error_bodies.error_format(
            message=(
                "The model server failed before answering and the gateway's retry budget"
                " for this model is spent; retry later."
            ),
            code="retry_budget_exhausted",
            param=None,
            error_type="server_error",
        ),
    )
    mapper.headers_to_add.append(_retry_after(str(UNAVAILABLE_RETRY_AFTER_S)))
    return mapper


def _retry_after(value: str) -> _Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=RETRY_AFTER_HEADER, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _route_metadata(key: str) -> str:
    """The command operator printing the route's metadata `llm:<key>`."""
    return f"%METADATA(ROUTE:{names.METADATA_NAMESPACE}:{key})%"


def _tenant_share_full(tenants: TenantsConfig, tenant: str) -> _Any:
    """429 `tenant_share_exceeded` with Retry-After for a request of weighted `tenant`
    that its lane's circuit breaker refused (flag UO): the tenant's fair share of the band
    is full (routes.py sends all of its Standard and Sheddable requests to its lane; its
    Critical ones are never refused). Told from a full band's 429 by the tenant (header or
    `llm:tenant`), as the rate limit's is; band, pool and Retry-After from the route."""
    band, pool = _route_metadata(names.BAND_KEY), _route_metadata(names.POOL_KEY)
    wait = _route_metadata(names.RETRY_AFTER_KEY)
    body = _error_bodies.error_format(
        message=(
            f"Tenant {tenant} has its full share of the {band} band of pool {pool} in"
            f" flight; retry after {wait} s."
        ),
        code="tenant_share_exceeded",
        param=None,
        error_type=names.RATE_LIMIT_ERROR_TYPE,
    )
    overflow = accesslog_pb2.AccessLogFilter(
        response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=["UO"])
    )
    named = _tenant_limits.is_tenant(tenants, tenant)
    return hcm_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(
            and_filter=accesslog_pb2.AndFilter(filters=[overflow, named])
        ),
        status_code=wrappers_pb2.UInt32Value(value=429),
        headers_to_add=[_retry_after(wait)],
        body_format_override=body,
    )


def _band_full() -> _Any:
    """429 with Retry-After for a request a band's circuit breaker refused (flag UO); the
    values come from the route's metadata (routes.py)."""
    band, pool = _route_metadata(names.BAND_KEY), _route_metadata(names.POOL_KEY)
    wait = _route_metadata(names.RETRY_AFTER_KEY)
    body = _error_bodies.error_format(
        message=f"The {band} band of pool {pool} is full; retry after {wait} s.",
        code="rate_limit_exceeded",
        param=None,
        error_type=names.RATE_LIMIT_ERROR_TYPE,
    )
    return hcm_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(
            response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=["UO"])
        ),
        status_code=wrappers_pb2.UInt32Value(value=429),
        headers_to_add=[_retry_after(wait)],
        body_format_override=body,
    )


def _tenant_limited(tenants: TenantsConfig, tenant: str, requests_per_s: float) -> _Any:
    """429 `tenant_rate_limit_exceeded` for a request of `tenant` the tenants' local rate
    limit refused (_tenant_limits.py), naming the tenant and its limit, with Retry-After
    the seconds its bucket takes to refill, read from the virtual host's metadata (RDS:
    it follows the split of the limit over the Envoys without a listener update). Told by
    its status and the tenant (header or metadata): the filter flags the reply RL only
    after the mappers ran (as the codec does DPE), and its `x-ratelimit-*` headers are
    added after them too (both verified on Envoy 1.40), so one mapper per tenant says its
    own limit. No other reply of Envoy's own is a 429 before the mappers."""
    wait = _tenant_limits.retry_after_format(tenant)
    body = _error_bodies.error_format(
        message=(
            f"Tenant {tenant} is over its request rate limit of"
            f" {requests_per_s:g} requests per second; retry after {wait} s."
        ),
        code="tenant_rate_limit_exceeded",
        param=None,
        error_type=names.RATE_LIMIT_ERROR_TYPE,
    )
    named = _tenant_limits.is_tenant(tenants, tenant)
    return hcm_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(
            and_filter=accesslog_pb2.AndFilter(filters=[_status_filter(429), named])
        ),
        headers_to_add=[_retry_after(wait)],
        body_format_override=body,
    )


def _status_filter(status: int) -> _Any:
    return accesslog_pb2.AccessLogFilter(
        status_code_filter=_status_comparison(accesslog_pb2.ComparisonFilter.EQ, status)
    )


def _status_comparison(op: int, status: int) -> _Any:
    return accesslog_pb2.StatusCodeFilter(
        comparison=accesslog_pb2.ComparisonFilter(
            op=op,
            value=base_pb2.RuntimeUInt32(
                default_value=status, runtime_key=f"llm.local_reply.status_{status}"
            ),
        )
    )
