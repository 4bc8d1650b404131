"""The route table: the paths the gateway serves, model name to pool, and OpenAI-style
refusals for everything else.

**A closed data path.** Only FORWARDED_PATHS (`POST /v1/chat/completions`,
`POST /v1/completions`) ever reach a model server, by exact path (the query string aside:
Envoy matches `path` and `safe_regex` without it; no normalization, so `/v1//completions`,
`/v1/./completions` or `/v1/chat%2Fcompletions` are other paths). Envoy answers
`GET /v1/models` and `GET /v1/models/{id}` itself from the config, and everything else
with a JSON 404: a model server's own `/metrics`, `/health` or admin paths are not
reachable through the listener, whatever model the request names.

json_to_metadata (listeners.py) leaves the body's `model` in dynamic metadata
`llm:model`: the JSON value itself, names.MODEL_MISSING when the body has no `model` (or
there is no body), or names.MODEL_INVALID when the body is not JSON. It writes one of
these for every request it sees, so every route but the last asks for `llm:model` to be
there (any value): they match once json_to_metadata has read the request. Routes, first
match wins:

0. a forwarded path with a method other than POST → 405 `method_not_allowed`, `allow: POST`;
1. per model M: `llm:model == M` → M's pool (the body names the model);
2. per model M: `llm:model == MODEL_MISSING` and header `model_header == M` → M's pool
   (the header is used only when the body has no `model`: the body wins);
3. `MODEL_MISSING` with the header set → 404 naming the header's model;
4. `MODEL_MISSING` → 400 (no model given);
5. `MODEL_INVALID` → 400 (body not JSON, or not a JSON content-type);
6. any other string → 404 naming the model;
7. any other value (number, boolean) → 400 (`model` must be a string);
8. the model paths Envoy answers itself (_model_paths):
   a. `GET /v1/models` → 200, the model list (_model_objects);
   b. per model M: `GET /v1/models/<M, percent-encoded>` → 200, M's model object. The
      id is matched in the two encodings clients send: RFC 3986 `pchar` (the OpenAI SDK's
      `/` is `%2F`) and the same with `/` left as is (`/v1/models/org/name`);
   c. `GET /v1/models/<anything else>` → 404 `model_not_found`;
   d. any other method on `/v1/models` or under it → 405 `method_not_allowed`, `allow: GET`;
9. any other path → 404 `not_found`, echoing the method and the path as OpenAI does
   (`Invalid URL (GET /metrics).`);
10. no metadata at all → the never-existing cluster names.UNROUTED_CLUSTER.

Routes 1-7 match FORWARDED_PATHS only (one RE2 alternation of the exact paths), and route
0 leaves them POSTs. The model paths come after them: Envoy tries routes in order, and a
completion, the traffic that counts, should not first be compared with two routes per
model. All direct responses of 0-9 carry `llm:model`, which the local reply mappers
(listeners.py) use to tell them from the replies Envoy makes before its filters read a
request.

Route 10 is not an error path. The connection manager picks a route from the headers
alone, before json_to_metadata has read the body, and the body buffer limit of the
stream comes from *that* route's entry: a direct_response route has none, so Envoy kept
its 1 MiB default and answered 413 to larger prompts even with the virtual host's limit
raised. A forwarding route as the headers-only match carries the virtual host's
`request_body_buffer_limit`; json_to_metadata then always writes a key, clears the route
cache, and one of routes 0-9 is chosen (for any path: a body over 1 MiB but within the
limit sent to a path not served gets its 404 too, not a 413). Should it ever not (a bug),
the request gets Envoy's 500 for a missing cluster instead of reaching a wrong pool.

**Model objects** (OpenAI's `{"id", "object": "model", "created", "owned_by"}`) are
built from the config alone: every model and LoRA adapter of every pool (`owned_by`: the
pool; an adapter's `parent`: the pool's first model, its base) and every
`model_rewrites` name (`owned_by`: the pools it splits to). `created` is MODEL_CREATED,
a constant: the gateway knows no creation time, and the route config's version is a
hash of its content, which must agree across restarts and server replicas. The list is
sorted by id, rendered compactly as JSON into the route config (its size raises
`max_direct_response_body_size_bytes` above Envoy's 4 KiB default as needed).

Every route to a pool sets names.ROUTED_MODEL_HEADER to the model it was routed by.

**Splits.** A model in `model_rewrites` has, instead of routes 1 and 2, one route each
(`split-model/M`, `split-header/M`, each first among the routes of its kind) with
weighted clusters: one per target, to the target's pool (its LoRA subset for an
adapter), setting names.ROUTED_MODEL_HEADER to the target. Envoy picks the target per
request by weight.

"Model" above means a pool's models and its LoRA adapters alike. Two refinements:

- **LoRA affinity.** A route for adapter A carries `metadata_match` `envoy.lb: {lora: A}`:
  the pool's subset balancer (clusters.py) sends it to A's holders, or, when no healthy
  pod holds A, over the whole pool.
- **Session affinity.** In a pool with `session_affinity`, routes 1 and 2 each come in
  three (four with prompt-prefix keys), all but the last to the pool's session cluster
  (Maglev with bounded load, clusters.py) with a hash policy on names.SESSION_HEADER:
  a. `session-<kind>/M`: the same match, and the client sent a non-empty
     names.SESSION_HEADER;
  b. `session-key-<kind>/M`: the same match, and `llm:session_key` (the body's
     `prompt_cache_key`, else `user`; listeners.py) is a non-empty string without control
     characters. Its per-route header_mutation config writes that key, cut to
     MAX_SESSION_KEY_CHARS, into names.SESSION_HEADER before the router hashes it;
  b'. only with `balancing.prefix_key_bytes` above 0: `prefix-<kind>/M`, the same match,
     and the body's `prompt` is a string (of at most 8 KiB: listeners.py) without DEL
     (PROMPT_PREFIX_REGEX). Its header_mutation writes the prompt's first
     `prefix_key_bytes` bytes as JSON text into names.SESSION_HEADER (JSON escapes the
     control characters a header cannot carry), so prompts that share that prefix go to
     one pod. Only completions: a chat's messages are out of json_to_metadata's reach;
  c. the plain route to the pool's cluster (weighted least request), for requests
     without a key.
  Why not one filter-wide mutation and one "header present" route: a hash policy reads
  headers only, and a header value with CR, LF or NUL makes Envoy 1.40 refuse the
  upstream request (503, no bytes sent). A body key with such characters fails (b)'s
  regex and is balanced as keyless instead; the client's own header cannot carry them.
- **Long prompts.** In a pool with a long-prompt lane (config.lanes: GPU-aware, and
  `balancing.long_prompt_bytes` above 0), route 1 or 2 (c above with session affinity) is
  preceded by `long-<kind>/M`: the same match, and a `content-length` of at least
  `long_prompt_bytes`, to the pool's `<pool>/long` cluster (clusters.py). Same endpoints
  and balancing; the load reports count those requests apart, per pod, so the policy can
  steer other requests away from a pod busy with a long prefill. A session key wins (its
  prefix is cached where the key goes); a body sent without content-length (chunked) is
  not told apart, and splits have no long-prompt route.

**Flow control** (`flow_control.enabled`). Every route to a pool above (a route of a
split too) becomes a group of classification routes, each to a band cluster of the pool
(names.band_cluster_name; clusters.py), first match wins:

a. `<kind>/<M>/<band>/objective/<O>`: names.OBJECTIVE_HEADER is exactly objective O (one
   route per objective in `flow_control.objectives`); band from its priority. An unknown
   objective name matches none of these and falls through to b and c, as if absent;
b. `<kind>/<M>/<band>/band/<asked>`: the `flow_control.band_header` names a band
   (case-insensitive). No route for the band that c gives anyway;
c. `<kind>/<M>/<band>`: the model's `default_band` (`flow_control.models`, else standard).

Every band is capped at the model's `max_band`, so a client cannot ask for more than its
model is allowed. Objectives are exact matches, not one regex alternation: Envoy refuses a
regex over RE2 program size 100 (`re2.max_program_size.error_level`), which a few long
names exceed. Session affinity and long-prompt routes of a model come per band in the same
way, to the band's session or long-prompt cluster. Each band route carries route metadata
`llm: {band, pool, retry_after_s}`, which the 429 of a full band prints (listeners.py).
A split's `retry_after_s` is the largest of its target pools' (the client waits for the
slowest rather than retrying too soon), and its `pool` lists them.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any as _Any
from urllib.parse import quote

from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2, value_pb2
from envoy.type.v3 import range_pb2
from google.protobuf import struct_pb2, wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.config import (
    BANDS,
    Band,
    Lane,
    ModelBands,
    ModelRewrite,
    PoolConfig,
    RoutingConfig,
)
from xds_server.envoy import _error_bodies, _protos, names
from xds_server.envoy.listeners import (
    HEADER_MUTATION_FILTER,
    PROMPT_KEY,
    PROMPT_NAMESPACE,
    STREAM_KEY,
    bounds_streams,
)
from xds_server.errors import ResourceBuildError
from xds_server.policy.admission import PoolAdmission

__all__ = [
    "FORWARDED_PATHS",
    "MAX_ECHOED_MODEL_CHARS",
    "MAX_ECHOED_PATH_CHARS",
    "MAX_SESSION_KEY_CHARS",
    "MODELS_PATH",
    "MODEL_CREATED",
    "PREVIOUS_HOSTS_PREDICATE",
    "PROMPT_PREFIX_REGEX",
    "RETRY_ON",
    "SESSION_KEY_REGEX",
    "build_routes",
    "build_spill_routes",
    "retry_after_of",
]

# The allow-list: the only paths a request reaches a model server on, each POST only,
# matched exactly (module docstring). Another OpenAI path (`/v1/embeddings`,
# `/v1/responses`) is served once it is added here.
FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions")
_FORWARDED_METHOD = "POST"

# Answered by Envoy from the config: the model list, and `MODELS_PATH/<id>` (GET only).
MODELS_PATH = "/v1/models"
_MODELS_METHOD = "GET"

# The `created` of every model object: fixed, so that the route config's content hash
# (its version) is the same on every server replica and after every restart.
MODEL_CREATED = 0

# Refusals of a path echo the method and the path, truncated like model names.
MAX_ECHOED_PATH_CHARS = 256
_MAX_ECHOED_METHOD_CHARS = 32

# RFC 3986 `pchar` besides the unreserved characters, which quote() never encodes: what
# a path segment may carry unencoded (the OpenAI SDK encodes model ids this way).
_PCHAR_SAFE = "!$&'()*+,;=:@"

# Envoy's limit on a direct response's `body` when the route config sets none.
_DEFAULT_DIRECT_RESPONSE_BYTES = 4096

# What a route retries (_add_retries): failures before any response byte came.
RETRY_ON = "connect-failure,refused-stream,reset"
PREVIOUS_HOSTS_PREDICATE = "envoy.retry_host_predicates.previous_hosts"

# Error messages echo the requested model, truncated to this many characters so a huge
# `model` value does not come back in full (the formatter's `:N` suffix).
MAX_ECHOED_MODEL_CHARS = 256

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

# The end of the long-prompt route's content-length range (exclusive): no end.
_MAX_INT64 = 2**63 - 1

# Envoy refuses these in header values (HTTP_HEADER_VALUE), and routed requests carry the
# model name in names.ROUTED_MODEL_HEADER.
_HEADER_UNSAFE = frozenset("\r\n\0")


def build_routes(
    config: RoutingConfig, retry_after: Mapping[tuple[str, Band], int] | None = None
) -> list[_Any]:
    """The route configurations for `config`: the listener's, named names.ROUTE_CONFIG_NAME,
    then one per spill listener (build_spill_routes), in config order.

    `retry_after` gives, per (pool name, band), the seconds a refused request of that band
    is told to wait (the policy's expected drain time); a pair it lacks, or None, gets
    `flow_control.retry_after_min_s`. Values are kept within the config's bounds. Used only
    when flow control is enabled.

    Raises ResourceBuildError when a pool serves a model named like a sentinel (names.SENTINELS),
    which the routes could not tell apart from a request without a model, or a model
    whose name cannot be a header value (Envoy would reject the whole route config).
    """
    rewrites = {r.model: r for r in config.model_rewrites}
    served = [
        (pool, model, model in pool.adapters)
        for pool in config.pools
        for model in (*pool.models, *pool.adapters)
        if model not in rewrites
    ]
    reserved = sorted(m for _, m, _ in served if m in names.SENTINELS)
    if reserved:
        raise ResourceBuildError(f"model names reserved by the gateway: {', '.join(reserved)}")
    unsendable = sorted(repr(m) for _, m, _ in served if _HEADER_UNSAFE.intersection(m))
    if unsendable:
        raise ResourceBuildError(f"model names with CR, LF or NUL: {', '.join(unsendable)}")
    unsendable = sorted(repr(m) for m in rewrites if _HEADER_UNSAFE.intersection(m))
    if unsendable:
        raise ResourceBuildError(
            f"rewritten model names with CR, LF or NUL: {', '.join(unsendable)}"
        )
    header = config.listener.model_header
    waits = _RetryAfter(config, retry_after or {})
    routes = [_other_methods(path, _FORWARDED_METHOD) for path in FORWARDED_PATHS]
    for kind in ("model", "header"):
        for rewrite in config.model_rewrites:
            match = _by_model(header, rewrite.model, kind=kind)
            if not config.flow_control.enabled:
                routes.append(_split(config, rewrite, kind=kind, match=match))
                continue
            for suffix, band, banded in _classified(config, rewrite.model, match):
                route = _split(config, rewrite, kind=kind, match=banded, band=band)
                route.name += suffix
                pools = _split_pools(config, rewrite)
                wait = max(waits.of(pool, band) for pool in pools)
                route.metadata.CopyFrom(_band_metadata(band, " or ".join(pools), wait))
                routes.append(route)
        for pool, model, adapter in served:
            match = _by_model(header, model, kind=kind)
            if not config.flow_control.enabled:
                routes += _to_pool(config, pool, model, adapter=adapter, kind=kind, match=match)
                continue
            for suffix, band, banded in _classified(config, model, match):
                metadata = _band_metadata(band, pool.name, waits.of(pool.name, band))
                for route in _to_pool(
                    config, pool, model, adapter=adapter, kind=kind, match=banded, band=band
                ):
                    route.name += suffix
                    route.metadata.CopyFrom(metadata)
                    routes.append(route)
    routes.extend(_refusals(header))
    routes.extend(_model_paths(config))
    routes.append(
        _refusal(
            name="error/not_found",
            match=rc_pb2.RouteMatch(prefix="/", dynamic_metadata=[_READ]),
            status=404,
            message=f"Invalid URL ({_ECHOED_METHOD} {_ECHOED_PATH}).",
            code="not_found",
            param=None,
        )
    )
    routes.append(
        rc_pb2.Route(
            name="unrouted",
            match=rc_pb2.RouteMatch(prefix="/"),
            route=rc_pb2.RouteAction(
                cluster=names.UNROUTED_CLUSTER,
                cluster_not_found_response_code=rc_pb2.RouteAction.INTERNAL_SERVER_ERROR,
            ),
        )
    )
    virtual_host = rc_pb2.VirtualHost(
        name=names.VIRTUAL_HOST_NAME,
        domains=["*"],
        routes=routes,
        # Replaces the deprecated per_request_buffer_limit_bytes (both work on 1.40).
        request_body_buffer_limit=wrappers_pb2.UInt64Value(value=config.listener.max_request_bytes),
    )
    spills = [build_spill_routes(config, pool) for pool in config.pools if config.spills(pool)]
    return [
        route_pb2.RouteConfiguration(
            name=names.ROUTE_CONFIG_NAME,
            virtual_hosts=[virtual_host],
            # Routes may name a pool's cluster before CDS has it, and the unrouted cluster
            # never exists (RDS defaults to false already; inline configs to true).
            validate_clusters=wrappers_pb2.BoolValue(value=False),
            # The model list grows with the models; Envoy refuses a larger body.
            max_direct_response_body_size_bytes=wrappers_pb2.UInt32Value(
                value=max(_DEFAULT_DIRECT_RESPONSE_BYTES, *map(_body_bytes, routes))
            ),
        ),
        *spills,
    ]


def build_spill_routes(config: RoutingConfig, pool: PoolConfig) -> _Any:
    """The routes of `pool`'s spill listener (listeners.py): every request to the pool's
    own cluster, an adapter's to its holders' subset. The request was routed and admitted
    on the way in (its band's session cluster counted it), and names.ROUTED_MODEL_HEADER
    says which model it was routed by: a LoRA adapter's requests are told apart by it."""
    cluster = names.cluster_name(pool.name)
    routes = []
    for adapter in pool.adapters:
        match = rc_pb2.RouteMatch(
            prefix="/",
            headers=[
                rc_pb2.HeaderMatcher(
                    name=names.ROUTED_MODEL_HEADER,
                    string_match=string_pb2.StringMatcher(exact=adapter),
                )
            ],
        )
        action = _action(config, cluster, adapter, adapter=True, hashed=False)
        routes.append(rc_pb2.Route(name=f"spill/{adapter}", match=match, route=action))
    action = _action(config, cluster, "", adapter=False, hashed=False)
    routes.append(rc_pb2.Route(name="spill", match=rc_pb2.RouteMatch(prefix="/"), route=action))
    return route_pb2.RouteConfiguration(
        name=names.spill_listener_name(pool.name),
        virtual_hosts=[
            rc_pb2.VirtualHost(
                name=names.VIRTUAL_HOST_NAME,
                domains=["*"],
                routes=routes,
                request_body_buffer_limit=wrappers_pb2.UInt64Value(
                    value=config.listener.max_request_bytes
                ),
            )
        ],
    )


def retry_after_of(admissions: Mapping[str, PoolAdmission]) -> dict[tuple[str, Band], int]:
    """The Retry-After seconds of each (pool, band) as the admissions decided them, in the
    shape `build_routes` takes."""
    return {
        (pool, band): admission.retry_after_s[band]
        for pool, admission in admissions.items()
        for band in BANDS
    }


class _RetryAfter:
    """The Retry-After seconds of a (pool, band), within the config's bounds."""

    def __init__(self, config: RoutingConfig, given: Mapping[tuple[str, Band], int]) -> None:
        self._low = config.flow_control.retry_after_min_s
        self._high = config.flow_control.retry_after_max_s
        self._given = given

    def of(self, pool: str, band: Band) -> int:
        return min(max(self._given.get((pool, band), self._low), self._low), self._high)


def _cap(band: Band, max_band: Band) -> Band:
    """`band`, or `max_band` when that is less important (BANDS: most important first)."""
    return BANDS[max(BANDS.index(band), BANDS.index(max_band))]


def _classified(config: RoutingConfig, model: str, match: _Any) -> Iterator[tuple[str, Band, _Any]]:
    """(route name suffix, band, match) for each classification route of `model`'s `match`,
    in first-match order (module docstring: a, b, c)."""
    flow = config.flow_control
    bands = flow.models.get(model, ModelBands())
    default = _cap(bands.default_band, bands.max_band)

    def with_header(name: str, value: _Any) -> _Any:
        banded = rc_pb2.RouteMatch()
        banded.CopyFrom(match)
        banded.headers.append(rc_pb2.HeaderMatcher(name=name, string_match=value))
        return banded

    for objective, priority in sorted(flow.objectives.items()):
        band = _cap(flow.band_of_priority(priority), bands.max_band)
        exact = string_pb2.StringMatcher(exact=objective)
        yield f"/{band}/objective/{objective}", band, with_header(names.OBJECTIVE_HEADER, exact)
    for asked in BANDS:
        band = _cap(asked, bands.max_band)
        if band != default:
            value = string_pb2.StringMatcher(exact=asked, ignore_case=True)
            yield f"/{band}/band/{asked}", band, with_header(flow.band_header, value)
    yield f"/{default}", default, match


def _band_metadata(band: Band, pool: str, retry_after_s: int) -> _Any:
    """Route metadata `llm: {band, pool, retry_after_s}`, printed by the 429 of a full band."""
    values = struct_pb2.Struct()
    values[names.BAND_KEY] = band
    values[names.POOL_KEY] = pool
    values[names.RETRY_AFTER_KEY] = retry_after_s
    metadata = base_pb2.Metadata()
    metadata.filter_metadata[names.METADATA_NAMESPACE].CopyFrom(values)
    return metadata


def _split_pools(config: RoutingConfig, rewrite: ModelRewrite) -> list[str]:
    """The pools a split can send to (targets with weight), sorted, each once."""
    # By name: a PoolConfig with a `selector` holds a dict, and cannot be hashed.
    pools = (config.pool_of(t.model) for t in rewrite.targets if t.weight)
    return sorted({p.name for p in pools if p is not None})


def _by_model(header: str, model: str, *, kind: str) -> _Any:
    """Route kind `model` (the body names `model`) or `header` (only the header does)."""
    if kind == "model":
        return _match(metadata=_string(exact=model))
    return _by_header(header, model)


def _by_header(header: str, model: str) -> _Any:
    """Requests without a body `model` whose `header` names `model`."""
    exact = string_pb2.StringMatcher(exact=model)
    by_header = rc_pb2.HeaderMatcher(name=header, string_match=exact)
    return _match(metadata=_string(exact=names.MODEL_MISSING), headers=[by_header])


def _split(
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
    return rc_pb2.Route(name=f"split-{kind}/{rewrite.model}", match=match, route=action)


def _cluster(pool: str, band: Band | None, lane: Lane) -> str:
    """The cluster of `pool`'s `lane`, or of its `band` in that lane with flow control."""
    if band is not None:
        return names.band_cluster_name(pool, band, lane)
    return names.lane_cluster_name(pool, lane)


def _to_pool(
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
    long-prompt lane by the long-prompt route (module docstring); to the clusters of `band`
    when given (flow control)."""
    routes = []
    lanes = config.lanes(pool)
    if "session" in lanes:
        session_cluster = _cluster(pool.name, band, "session")
        by_header = rc_pb2.RouteMatch()
        by_header.CopyFrom(match)
        by_header.headers.append(
            rc_pb2.HeaderMatcher(
                name=names.SESSION_HEADER,
                # Non-empty: an empty key would hash every such request to one host.
                string_match=string_pb2.StringMatcher(
                    safe_regex=regex_pb2.RegexMatcher(regex=r"(?s).+")
                ),
            )
        )
        action = _action(config, session_cluster, model, adapter=adapter, hashed=True)
        routes.append(_route(f"session-{kind}/{model}", by_header, action, model))
        by_body = rc_pb2.RouteMatch()
        by_body.CopyFrom(match)
        by_body.dynamic_metadata.append(
            _metadata_matcher(names.SESSION_KEY, _string(regex=SESSION_KEY_REGEX))
        )
        action = _action(config, session_cluster, model, adapter=adapter, hashed=True)
        route = _route(f"session-key-{kind}/{model}", by_body, action, model)
        route.typed_per_filter_config[HEADER_MUTATION_FILTER].CopyFrom(_SESSION_KEY_TO_HEADER)
        routes.append(route)
        prefix_bytes = config.balancing.prefix_key_bytes
        if prefix_bytes > 0:
            by_prompt = rc_pb2.RouteMatch()
            by_prompt.CopyFrom(match)
            by_prompt.dynamic_metadata.append(
                metadata_pb2.MetadataMatcher(
                    filter=PROMPT_NAMESPACE,
                    path=[metadata_pb2.MetadataMatcher.PathSegment(key=PROMPT_KEY)],
                    value=_string(regex=PROMPT_PREFIX_REGEX),
                )
            )
            action = _action(config, session_cluster, model, adapter=adapter, hashed=True)
            route = _route(f"prefix-{kind}/{model}", by_prompt, action, model)
            route.typed_per_filter_config[HEADER_MUTATION_FILTER].CopyFrom(
                _prompt_prefix_to_header(prefix_bytes)
            )
            routes.append(route)
    if "long" in lanes:
        long_prompt = rc_pb2.RouteMatch()
        long_prompt.CopyFrom(match)
        long_prompt.headers.append(
            rc_pb2.HeaderMatcher(
                name="content-length",
                range_match=range_pb2.Int64Range(
                    start=config.balancing.long_prompt_bytes, end=_MAX_INT64
                ),
            )
        )
        action = _action(
            config, _cluster(pool.name, band, "long"), model, adapter=adapter, hashed=False
        )
        routes.append(_route(f"long-{kind}/{model}", long_prompt, action, model))
    cluster = _cluster(pool.name, band, "pool")
    action = _action(config, cluster, model, adapter=adapter, hashed=False)
    routes.append(_route(f"{kind}/{model}", match, action, model))
    if not bounds_streams(pool):
        return routes
    return [twin for route in routes for twin in (_streamed(pool, route), route)]


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
        _metadata_matcher(STREAM_KEY, value_pb2.ValueMatcher(bool_match=True))
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


def _action(
    config: RoutingConfig, cluster: str, model: str, *, adapter: bool, hashed: bool
) -> _Any:
    action = rc_pb2.RouteAction(
        cluster=cluster,
        # Always set: unset means Envoy's 15 s default, which would cut long
        # generations; 0 disables the timeout.
        timeout=_protos.duration(config.listener.request_timeout_s),
    )
    _add_retries(config, action)
    if adapter:
        action.metadata_match.CopyFrom(_lora_subset(model))
    if hashed:
        action.hash_policy.append(
            rc_pb2.RouteAction.HashPolicy(
                header=rc_pb2.RouteAction.HashPolicy.Header(header_name=names.SESSION_HEADER)
            )
        )
    return action


def _add_retries(config: RoutingConfig, action: _Any) -> None:
    """Retry a request that never got response headers on another pod (config.upstream).

    `connect-failure` and `refused-stream` are a pod that is gone or refuses; `reset` is a
    pod that reset the stream before answering (a crash mid-prefill): a generation can be
    started again from scratch. Envoy never retries once the response has begun, so a
    stream that was already answering is not repeated. `previous_hosts` sends each retry
    to a pod not tried yet (on the session ring too: the next host on it). The cluster's
    retry budget (clusters.py) bounds how many retries run at once.
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

# The request's method and path in a refusal's message (escaped by json_format).
_ECHOED_METHOD = f"%REQ(:METHOD):{_MAX_ECHOED_METHOD_CHARS}%"
_ECHOED_PATH = f"%REQ(:PATH):{MAX_ECHOED_PATH_CHARS}%"


def _model_paths(config: RoutingConfig) -> list[_Any]:
    """Routes 8a-8d of the module docstring: the model list and each model object, the
    404 of an unknown model id, and the 405s of other methods."""
    objects = _model_objects(config)
    routes = [
        _document(
            "models/list",
            _path_match(path=MODELS_PATH, method=_MODELS_METHOD),
            {"object": "list", "data": list(objects.values())},
        )
    ]
    for model, document in objects.items():
        segments = {quote(model, safe=_PCHAR_SAFE), quote(model, safe=_PCHAR_SAFE + "/")}
        for segment in sorted(segments):
            path = f"{MODELS_PATH}/{segment}"
            match = _path_match(path=path, method=_MODELS_METHOD)
            routes.append(_document(f"models/retrieve/{segment}", match, document))
    routes.append(
        _refusal(
            name="error/unknown_model_id",
            match=_path_match(prefix=MODELS_PATH + "/", method=_MODELS_METHOD),
            status=404,
            message=f"The model requested by `{_ECHOED_METHOD} {_ECHOED_PATH}` does not exist.",
            code="model_not_found",
        )
    )
    # GET is taken above: any other method.
    routes.append(_method_not_allowed(MODELS_PATH, _path_match(path=MODELS_PATH), _MODELS_METHOD))
    under = MODELS_PATH + "/"
    routes.append(_method_not_allowed(under, _path_match(prefix=under), _MODELS_METHOD))
    return routes


def _model_objects(config: RoutingConfig) -> dict[str, dict[str, _Any]]:
    """OpenAI's model object of every model a request can name, by id, sorted by id
    (module docstring)."""

    def model(model_id: str, owned_by: str, parent: str | None = None) -> dict[str, _Any]:
        document: dict[str, _Any] = {
            "id": model_id,
            "object": "model",
            "created": MODEL_CREATED,
            "owned_by": owned_by,
        }
        if parent is not None:
            document["parent"] = parent
        return document

    objects = {}
    for pool in config.pools:
        for name in pool.models:
            objects[name] = model(name, pool.name)
        for adapter in pool.adapters:
            objects[adapter] = model(adapter, pool.name, parent=pool.models[0])
    # A rewritten name is served by its split, even when a pool lists it too.
    for rewrite in config.model_rewrites:
        objects[rewrite.model] = model(rewrite.model, " or ".join(_split_pools(config, rewrite)))
    return dict(sorted(objects.items()))


def _document(name: str, match: _Any, document: Mapping[str, _Any]) -> _Any:
    """A 200 direct response with `document` as its JSON body.

    The JSON is rendered here, once, and sent as the literal `body`, which Envoy does not
    format (a text format would read the `%` of `50%-model` as an operator); the body
    format only wraps it, to set the content type.
    """
    text = json.dumps(document, separators=(",", ":"))
    return rc_pb2.Route(
        name=name,
        match=match,
        direct_response=rc_pb2.DirectResponseAction(
            status=200,
            body=base_pb2.DataSource(inline_string=text),
            body_format=substitution_format_string_pb2.SubstitutionFormatString(
                text_format_source=base_pb2.DataSource(inline_string="%LOCAL_REPLY_BODY%"),
                content_type="application/json",
            ),
        ),
    )


def _body_bytes(route: _Any) -> int:
    """The size of `route`'s literal direct response body (0 for any other route)."""
    return len(route.direct_response.body.inline_string.encode())


def _other_methods(path: str, allowed: str) -> _Any:
    """405 for the requests on exactly `path` with any method but `allowed`."""
    match = _path_match(path=path, method=allowed, invert_method=True)
    return _method_not_allowed(path, match, allowed)


def _method_not_allowed(path: str, match: _Any, allowed: str) -> _Any:
    """405 with `allow: <allowed>` (RFC 9110 15.5.6) for the requests of `match` (on
    `path`, which names the route)."""
    route = _refusal(
        name=f"error/method_not_allowed{path}",
        match=match,
        status=405,
        message=f"The method {_ECHOED_METHOD} is not allowed on `{_ECHOED_PATH}`; use {allowed}.",
        code="method_not_allowed",
        param=None,
    )
    route.response_headers_to_add.append(
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="allow", value=allowed),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )
    return route


def _path_match(
    *,
    path: str | None = None,
    prefix: str | None = None,
    method: str | None = None,
    invert_method: bool = False,
) -> _Any:
    """The requests for exactly `path` (or any path under `prefix`), with `method` (any
    other method when `invert_method`), once json_to_metadata has read them."""
    match = rc_pb2.RouteMatch(dynamic_metadata=[_READ])
    if path is not None:
        match.path = path
    else:
        match.prefix = prefix or "/"
    if method is not None:
        match.headers.append(
            rc_pb2.HeaderMatcher(
                name=":method",
                string_match=string_pb2.StringMatcher(exact=method),
                invert_match=invert_method,
            )
        )
    return match


def _refusals(header: str) -> list[_Any]:
    echoed_header = f"%REQ({header}):{MAX_ECHOED_MODEL_CHARS}%"
    echoed_body = (
        f"%DYNAMIC_METADATA({names.METADATA_NAMESPACE}:{names.MODEL_KEY}):{MAX_ECHOED_MODEL_CHARS}%"
    )
    return [
        _refusal(
            name="error/unknown_header_model",
            match=_match(
                metadata=_string(exact=names.MODEL_MISSING),
                headers=[rc_pb2.HeaderMatcher(name=header, present_match=True)],
            ),
            status=404,
            message=f"The model `{echoed_header}` does not exist.",
            code="model_not_found",
        ),
        _refusal(
            name="error/missing_model",
            match=_match(metadata=_string(exact=names.MODEL_MISSING)),
            status=400,
            message=(
                f"You must provide a model parameter: `model` in the JSON body, "
                f"or the {header} header."
            ),
            code="missing_model",
        ),
        _refusal(
            name="error/invalid_body",
            match=_match(metadata=_string(exact=names.MODEL_INVALID)),
            status=400,
            message="The request body is not valid JSON, or its content-type is not JSON.",
            code="invalid_json",
        ),
        _refusal(
            name="error/unknown_model",
            match=_match(metadata=_string(regex=r"(?s).*")),
            status=404,
            message=f"The model `{echoed_body}` does not exist.",
            code="model_not_found",
        ),
        _refusal(
            name="error/model_not_string",
            match=_match(metadata=value_pb2.ValueMatcher(present_match=True)),
            status=400,
            message="`model` must be a string.",
            code="invalid_type",
        ),
    ]


def _refusal(
    *, name: str, match: _Any, status: int, message: str, code: str, param: str | None = "model"
) -> _Any:
    body = _error_bodies.error_format(message=message, code=code, param=param)
    return rc_pb2.Route(
        name=name,
        match=match,
        direct_response=rc_pb2.DirectResponseAction(status=status, body_format=body),
    )


# Routes 1-7 (module docstring): the forwarded paths, exactly, as one RE2 alternation.
_FORWARDED_REGEX = "|".join(re.escape(path) for path in FORWARDED_PATHS)


def _match(*, metadata: _Any | None = None, headers: list[_Any] | None = None) -> _Any:
    """A forwarded path (FORWARDED_PATHS); `metadata` is a ValueMatcher applied to
    `llm:model`."""
    match = rc_pb2.RouteMatch(
        safe_regex=regex_pb2.RegexMatcher(regex=_FORWARDED_REGEX), headers=headers or []
    )
    if metadata is not None:
        match.dynamic_metadata.append(_metadata_matcher(names.MODEL_KEY, metadata))
    return match


def _metadata_matcher(key: str, value: _Any) -> _Any:
    """`value` (a ValueMatcher) applied to dynamic metadata `llm:<key>`."""
    return metadata_pb2.MetadataMatcher(
        filter=names.METADATA_NAMESPACE,
        path=[metadata_pb2.MetadataMatcher.PathSegment(key=key)],
        value=value,
    )


def _string(*, exact: str | None = None, regex: str | None = None) -> _Any:
    """A ValueMatcher for a string value, equal to `exact` or fully matching `regex`."""
    if regex is not None:
        matcher = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=regex))
    else:
        matcher = string_pb2.StringMatcher(exact=exact)
    return value_pb2.ValueMatcher(string_match=matcher)


# Route matcher: json_to_metadata has read the request (it always writes `llm:model`).
_READ = _metadata_matcher(names.MODEL_KEY, value_pb2.ValueMatcher(present_match=True))
