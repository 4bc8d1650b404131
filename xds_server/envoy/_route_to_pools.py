"""The routes that send a request on to a pool (routes.py's docstring, routes 1 and 2):
to the pool's lanes (session affinity, long prompts), the streamed requests' twins, a
split's weighted targets, and what every such route does (timeout, retries, LoRA subset,
names.ROUTED_MODEL_HEADER).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any as _Any

from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import (
    previous_priorities_config_pb2,
)
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2, value_pb2
from envoy.type.v3 import range_pb2
from google.protobuf import struct_pb2, wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.config import Band, Lane, ModelRewrite, PoolConfig, RoutingConfig
from xds_server.envoy import _protos, names
from xds_server.envoy._route_matches import metadata_matcher, string, with_header, with_metadata
from xds_server.envoy.listeners import (
    HEADER_MUTATION_FILTER,
    PROMPT_KEY,
    PROMPT_NAMESPACE,
    STREAM_KEY,
    bounds_streams,
)

__all__ = [
    "MAX_SESSION_KEY_CHARS",
    "PREVIOUS_HOSTS_PREDICATE",
    "PREVIOUS_PRIORITIES",
    "PROMPT_PREFIX_REGEX",
    "RETRY_ON",
    "SESSION_KEY_REGEX",
    "route_action",
    "route_metadata",
    "split",
    "split_pools",
    "to_pool",
]

# What a route retries (_add_retries): failures before any response byte came.
RETRY_ON = "connect-failure,refused-stream,reset"
PREVIOUS_HOSTS_PREDICATE = "envoy.retry_host_predicates.previous_hosts"
PREVIOUS_PRIORITIES = "envoy.retry_priorities.previous_priorities"

# A body session key becomes a header only if it has no control character (RE2, whole
# value): Envoy refuses to send a header value with CR, LF or NUL upstream (the request
# fails with a 503), and the others are not valid in HTTP field values either.
SESSION_KEY_REGEX = r"[^\x00-\x1f\x7f]+"

# The body session key is cut to this many bytes in the header: it is a hash key, and a
# long `user` must not become a long upstream header.
MAX_SESSION_KEY_CHARS = 256

# A prompt is a hash key only without DEL (RE2, whole value): the header carries it as JSON
# text, where every other control character is escaped (`\n`, `\u0001`), but DEL is not,
# and Envoy 1.40 refuses a header value with it (503 `invalid header value`).
PROMPT_PREFIX_REGEX = r"[^\x7f]+"

# `{"prompt":"`: what the prompt's namespace printed as JSON starts with (routes cut the
# header after the prefix: `balancing.prefix_key_bytes` more bytes).
_PROMPT_JSON_OPENING = len(f'{{"{PROMPT_KEY}":"')

# Where a session route's key comes from, by the route's name prefix (`_session_routes`),
# as route metadata for the access log: never the key itself.
_SESSION_KEY_FROM = {"session": "header", "session-key": "body", "prefix": "prompt_prefix"}

# The end of the long-prompt route's content-length range (exclusive): no end.
_MAX_INT64 = 2**63 - 1


def to_pool(
    config: RoutingConfig,
    pool: PoolConfig,
    model: str,
    *,
    adapter: bool,
    kind: str,
    match: _Any,
    band: Band | None = None,
) -> list[_Any]:
    """The routes of `model` for one `match`: `<kind>/<model>`, preceded in a pool with session
    affinity by the session routes for a client's key, for a body's and for a prompt's
    prefix (when `prefix_key_bytes` is set), and in a pool with a
    long-prompt lane by the long-prompt route (routes.py's docstring); to the clusters of
    `band` when given (flow control). With bounds on streams, each comes after its twin
    for streamed requests."""
    to = _ModelTo(config=config, pool=pool, model=model, adapter=adapter, kind=kind, band=band)
    lanes = config.lanes(pool)
    routes = []
    if "session" in lanes:
        routes += _session_routes(to, match, config.balancing.prefix_key_bytes)
    if "long" in lanes:
        routes.append(_long_prompt_route(to, match, config.balancing.long_prompt_bytes))
    routes.append(to.route("", "pool", match))
    if not bounds_streams(pool):
        return routes
    return [twin for route in routes for twin in (_streamed(pool, route), route)]


@dataclass(frozen=True, kw_only=True)
class _ModelTo:
    """What the routes of one model (for one route kind and band) share."""

    config: RoutingConfig
    pool: PoolConfig
    model: str
    adapter: bool
    kind: str
    band: Band | None

    def route(self, prefix: str, lane: Lane, match: _Any) -> _Any:
        """`<prefix>-<kind>/<model>` (`<kind>/<model>` without a prefix): `match` to the
        cluster of `lane`, hashed on names.SESSION_HEADER in the session lane."""
        name = f"{self.kind}/{self.model}"
        if prefix:
            name = f"{prefix}-{name}"
        cluster = _cluster(self.pool.name, self.band, lane)
        hashed = lane == "session"
        route = _route(
            name,
            match,
            route_action(self.config, cluster, self.model, adapter=self.adapter, hashed=hashed),
            self.model,
        )
        route.metadata.CopyFrom(
            route_metadata(
                self.pool.name,
                adapter=self.model if self.adapter else None,
                session_key_from=_SESSION_KEY_FROM.get(prefix),
            )
        )
        return route


def _session_routes(to: _ModelTo, match: _Any, prefix_bytes: int) -> list[_Any]:
    """Session affinity's routes (a, b and b' of routes.py's docstring): the client's
    key, the body's key, and (`prefix_bytes` above 0) the prompt's prefix."""
    by_client = with_header(
        match,
        rc_pb2.HeaderMatcher(
            name=names.SESSION_HEADER,
            # Non-empty: an empty key would hash every such request to one host.
            string_match=string_pb2.StringMatcher(
                safe_regex=regex_pb2.RegexMatcher(regex=r"(?s).+")
            ),
        ),
    )
    routes = [to.route("session", "session", by_client)]
    by_body = with_metadata(
        match, metadata_matcher(names.SESSION_KEY, string(regex=SESSION_KEY_REGEX))
    )
    routes.append(_mutating(to.route("session-key", "session", by_body), _SESSION_KEY_TO_HEADER))
    if prefix_bytes > 0:
        by_prompt = with_metadata(
            match,
            metadata_pb2.MetadataMatcher(
                filter=PROMPT_NAMESPACE,
                path=[metadata_pb2.MetadataMatcher.PathSegment(key=PROMPT_KEY)],
                value=string(regex=PROMPT_PREFIX_REGEX),
            ),
        )
        route = to.route("prefix", "session", by_prompt)
        routes.append(_mutating(route, _prompt_prefix_to_header(prefix_bytes)))
    return routes


def _long_prompt_route(to: _ModelTo, match: _Any, long_prompt_bytes: int) -> _Any:
    """`long-<kind>/<model>`: a content-length of at least `long_prompt_bytes`, to the
    long-prompt lane."""
    long_prompt = with_header(
        match,
        rc_pb2.HeaderMatcher(
            name="content-length",
            range_match=range_pb2.Int64Range(start=long_prompt_bytes, end=_MAX_INT64),
        ),
    )
    return to.route("long", "long", long_prompt)


def _mutating(route: _Any, mutation: _Any) -> _Any:
    """`route`, with the per-route header_mutation config `mutation`."""
    route.typed_per_filter_config[HEADER_MUTATION_FILTER].CopyFrom(mutation)
    return route


def _streamed(pool: PoolConfig, route: _Any) -> _Any:
    """`route` for streamed requests only (`llm:stream` true), named `stream-<name>`, with
    the pool's bounds per try (PoolConfig.first_byte_s, stream_idle_s): a try that gets no
    response headers within `first_byte_s`, or no byte for `stream_idle_s`, is reset;
    one whose response had not begun is tried again on another pod (RETRY_ON's `reset`
    covers a try's timeouts), one mid-stream ends there. Matched before `route`, which
    serves the rest: a request that is not streamed sends nothing until it is done."""
    twin = rc_pb2.Route()
    twin.CopyFrom(route)
    twin.name = f"stream-{route.name}"
    twin.match.dynamic_metadata.append(
        metadata_matcher(STREAM_KEY, value_pb2.ValueMatcher(bool_match=True))
    )
    retry_policy = twin.route.retry_policy
    if not twin.route.HasField("retry_policy"):
        retry_policy.retry_on = RETRY_ON
        retry_policy.num_retries.value = 0
    if pool.first_byte_s > 0:
        retry_policy.per_try_timeout.CopyFrom(_protos.duration(pool.first_byte_s))
    if pool.stream_idle_s > 0:
        retry_policy.per_try_idle_timeout.CopyFrom(_protos.duration(pool.stream_idle_s))
    return twin


def split(
    config: RoutingConfig,
    rewrite: ModelRewrite,
    *,
    kind: str,
    match: _Any,
    band: Band | None = None,
) -> _Any:
    """`split-<kind>/<model>`: each request for the rewritten model goes to one target's pool
    (its `band` cluster, with flow control), picked by weight, with
    names.ROUTED_MODEL_HEADER naming the target (ModelRewrite)."""
    clusters = []
    for target in rewrite.targets:
        pool = config.pool_of(target.model)
        if pool is None or target.weight == 0:
            continue
        weighted = rc_pb2.WeightedCluster.ClusterWeight(
            name=_cluster(pool.name, band, "pool"),
            weight=wrappers_pb2.UInt32Value(value=target.weight),
            request_headers_to_add=[_model_header(target.model)],
        )
        if target.model in pool.adapters:
            weighted.metadata_match.CopyFrom(_lora_subset(target.model))
        clusters.append(weighted)
    action = rc_pb2.RouteAction(
        weighted_clusters=rc_pb2.WeightedCluster(clusters=clusters),
        timeout=_protos.duration(config.listener.request_timeout_s),
    )
    _add_retries(config, action)
    route = rc_pb2.Route(name=f"split-{kind}/{rewrite.model}", match=match, route=action)
    route.metadata.CopyFrom(route_metadata(" or ".join(split_pools(config, rewrite))))
    return route


def route_metadata(
    pool: str, *, adapter: str | None = None, session_key_from: str | None = None
) -> _Any:
    """Route metadata `llm: {pool, adapter, session_key_from}` (names.ADAPTER_KEY), which
    the access log prints; `adapter` and `session_key_from` only when given."""
    values = struct_pb2.Struct()
    values[names.POOL_KEY] = pool
    if adapter is not None:
        values[names.ADAPTER_KEY] = adapter
    if session_key_from is not None:
        values[names.SESSION_SOURCE_KEY] = session_key_from
    metadata = base_pb2.Metadata()
    metadata.filter_metadata[names.METADATA_NAMESPACE].CopyFrom(values)
    return metadata


def split_pools(config: RoutingConfig, rewrite: ModelRewrite) -> list[str]:
    """The pools a split can send to (targets with weight), sorted, each once."""
    # By name: a PoolConfig with a `selector` holds a dict, and cannot be hashed.
    pools = (config.pool_of(t.model) for t in rewrite.targets if t.weight)
    return sorted({p.name for p in pools if p is not None})


def _cluster(pool: str, band: Band | None, lane: Lane) -> str:
    """The cluster of `pool`'s `lane`, or of its `band` in that lane with flow control."""
    if band is not None:
        return names.band_cluster_name(pool, band, lane)
    return names.lane_cluster_name(pool, lane)


def route_action(
    config: RoutingConfig, cluster: str, model: str, *, adapter: bool, hashed: bool
) -> _Any:
    """The RouteAction to `cluster`: the request timeout and retries (config.listener,
    config.upstream), `model`'s LoRA subset when it is an `adapter`, and a hash policy on
    names.SESSION_HEADER when `hashed`."""
    action = rc_pb2.RouteAction(
        cluster=cluster,
        # Always set: unset means Envoy's 15 s default, which would cut long
        # generations; 0 disables the timeout.
        timeout=_protos.duration(config.listener.request_timeout_s),
    )
    pool = config.pool_of(model)
    # A bucketed session cluster's priority 1 is the pool, through the spill listener
    # (envoy/endpoints.py): a key whose pod just died is retried there, not on its pod.
    across = pool is not None and (bool(pool.remotes) or (hashed and config.bucket_homes(pool)))
    _add_retries(config, action, across_priorities=across)
    if adapter:
        action.metadata_match.CopyFrom(_lora_subset(model))
    if hashed:
        action.hash_policy.append(
            rc_pb2.RouteAction.HashPolicy(
                header=rc_pb2.RouteAction.HashPolicy.Header(header_name=names.SESSION_HEADER)
            )
        )
    return action


def _add_retries(config: RoutingConfig, action: _Any, *, across_priorities: bool = False) -> None:
    """Retry a request that never got response headers on another pod (config.upstream).

    `connect-failure` and `refused-stream` are a pod that is gone or refuses; `reset` is a
    pod that reset the stream before answering (a crash mid-prefill): a generation can be
    started again from scratch. Envoy never retries once the response has begun, so a
    stream that was already answering is not repeated. `previous_hosts` sends each retry
    to a pod not tried yet (on the session ring too: the next host on it). The cluster's
    retry budget (clusters.py) bounds how many retries run at once. `across_priorities`
    (a pool with remotes: EDS priority 1, envoy/endpoints.py): `previous_priorities`
    sends a retry to a priority not tried yet, so a request whose local pod just died
    goes to a remote cluster instead of to another local pod that may be dead too; on a
    bucketed session cluster (a key's bucket has one pod at priority 0) the retry goes to
    the pool, through the spill listener, instead of to the same pod again.
    """
    retries = config.upstream.retries
    if retries == 0:
        return
    retry = rc_pb2.RetryPolicy
    action.retry_policy.CopyFrom(
        retry(
            retry_on=RETRY_ON,
            num_retries=_protos.uint32(retries),
            retry_host_predicate=[
                retry.RetryHostPredicate(
                    name=PREVIOUS_HOSTS_PREDICATE,
                    typed_config=_protos.pack(previous_hosts_pb2.PreviousHostsPredicate()),
                )
            ],
            # Draws of the balancer before it settles for a host already tried.
            host_selection_retry_max_attempts=5,
            retry_back_off=retry.RetryBackOff(
                base_interval=_protos.duration(0.025), max_interval=_protos.duration(0.25)
            ),
        )
    )
    if across_priorities:
        action.retry_policy.retry_priority.CopyFrom(
            retry.RetryPriority(
                name=PREVIOUS_PRIORITIES,
                typed_config=_protos.pack(
                    previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=1)
                ),
            )
        )


def _lora_subset(adapter: str) -> _Any:
    """The `metadata_match` of the adapter's holders (clusters.py; endpoints.py lists them)."""
    lora = struct_pb2.Struct()
    lora[names.LORA_KEY] = adapter
    metadata = base_pb2.Metadata()
    metadata.filter_metadata[names.LB_METADATA_NAMESPACE].CopyFrom(lora)
    return metadata


def _model_header(model: str) -> _Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(
            key=names.ROUTED_MODEL_HEADER,
            # Header values are format strings: a literal % is written %%.
            value=model.replace("%", "%%"),
        ),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _route(name: str, match: _Any, action: _Any, model: str) -> _Any:
    return rc_pb2.Route(
        name=name, match=match, route=action, request_headers_to_add=[_model_header(model)]
    )


def _session_key_to_header() -> _Any:
    """Per-route header_mutation: names.SESSION_HEADER from `llm:session_key`."""
    value = (
        f"%DYNAMIC_METADATA({names.METADATA_NAMESPACE}:{names.SESSION_KEY})"
        f":{MAX_SESSION_KEY_CHARS}%"
    )
    return _header_from(value)


@functools.cache
def _prompt_prefix_to_header(prefix_bytes: int) -> _Any:
    """Per-route header_mutation: names.SESSION_HEADER from the first `prefix_bytes` bytes
    of the prompt as JSON text.

    The prompt's namespace is printed whole, as JSON (`{"prompt":"..."}`), not the prompt
    itself: a prompt's newline would make the header value invalid, its JSON escape does
    not. The formatter's `:N` cuts bytes (a multi-byte character may be cut: Envoy sends
    the header all the same, verified on 1.40).
    """
    value = f"%DYNAMIC_METADATA({PROMPT_NAMESPACE}):{_PROMPT_JSON_OPENING + prefix_bytes}%"
    return _header_from(value)


def _header_from(value: str) -> _Any:
    """Per-route header_mutation: names.SESSION_HEADER set to the format string `value`."""
    return _protos.pack(
        header_mutation_pb2.HeaderMutationPerRoute(
            mutations=header_mutation_pb2.Mutations(
                request_mutations=[
                    mutation_rules_pb2.HeaderMutation(
                        append=base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(key=names.SESSION_HEADER, value=value),
                            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                    )
                ]
            )
        )
    )


_SESSION_KEY_TO_HEADER = _session_key_to_header()
