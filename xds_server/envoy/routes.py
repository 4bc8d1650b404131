"""The route table: the paths the gateway serves, model name to pool, and OpenAI-style
refusals for everything else.

**A closed data path.** A request reaches a model server only by POST on a path of an
API its model's pool serves (`pools[].api`, apis.py: by default `/v1/chat/completions`,
`/v1/completions` and `/v1/responses`), by exact path (the query string aside: Envoy
matches `path` and `safe_regex` without it; no normalization, so `/v1//completions`,
`/v1/./completions` or `/v1/chat%2Fcompletions` are other paths). The "forwarded paths"
below are those of every pool's APIs together. Envoy answers `GET /v1/models` and
`GET /v1/models/{id}` itself from the config, and everything else with a JSON 404: a model
server's own `/metrics`, `/health` or admin paths, or an API no pool lists, are not
reachable through the listener, whatever model the request names.

json_to_metadata (listeners.py) leaves the body's `model` in dynamic metadata
`llm:model`: the JSON value itself, names.MODEL_MISSING when the body has no `model` (or
there is no body), or names.MODEL_INVALID when the body is not JSON. It writes one of
these for every request it sees, so every route but the last asks for `llm:model` to be
there (any value): they match once json_to_metadata has read the request. Routes, first
match wins:

0. a forwarded path with a method other than POST → 405 `method_not_allowed`, `allow: POST`;
1. per model M: `llm:model == M` on a path of M's pool → M's pool (the body names the
   model);
2. per model M: `llm:model == MODEL_MISSING` and header `model_header == M` on a path of
   M's pool → M's pool (the header is used only when the body has no `model`: the body
   wins);
2'. a model named (as in 1 or 2) on a forwarded path its pool does not serve → 404
   `not_found` (`Invalid URL (POST /v1/embeddings): the model `M` is not served on this
   path.`): per pool, its models in one or_match for the body's, and per model for the
   header's; only for pools that serve fewer paths than all pools together;
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

Routes 1-7 match forwarded paths only, as alternations of the exact paths
(_route_matches.py: RE2's program size limit cuts a long list into a few, one route each,
named `<name>#2` and on), and route 0 leaves them POSTs. The model paths come after them:
Envoy tries routes in order, and a completion, the traffic that counts, should not first
be compared with two routes per model. All direct responses of 0-9 carry `llm:model`,
which the local reply mappers (listeners.py) use to tell them from the replies Envoy makes
before its filters read a request.

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
request by weight, so a split takes the paths of the APIs all its targets' pools serve
(RoutingConfig.rewrite_api; the config refuses a split with none in common).

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

With weighted tenants (`flow_control.tenants.named.<tenant>.weight`), each group of a
Standard or Sheddable band's routes is preceded by each tenant's variants of its routes to
the pool's own lane (`<name>/t/<tenant>`: the same match and the tenant's header or
`llm:tenant`), to the tenant's lane `<pool>/<band>/t/<tenant>` (_route_tenants.py), with
`tenant` added to the route metadata. The routes grow by one or two (with a streamed twin)
per weighted tenant for each group.

**Where the parts are.** This module composes the table (build_routes) and the spill
listeners' routes; the routes are built in _route_matches (which requests a route takes),
_route_answers (the routes Envoy answers itself: 0, 2', 3-9), _route_to_pools (routes 1 and 2:
lanes, streamed twins, splits, retries), _route_bands (flow control) and _route_tenants
(weighted tenants' lanes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any as _Any

from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.config.route.v3 import route_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.apis import paths_of
from xds_server.config import Band, PoolConfig, RoutingConfig
from xds_server.envoy import _route_answers as answers
from xds_server.envoy import _tenant_limits, names
from xds_server.envoy._route_answers import (
    MAX_ECHOED_MODEL_CHARS,
    MAX_ECHOED_PATH_CHARS,
    MODEL_CREATED,
    MODELS_PATH,
)
from xds_server.envoy._route_bands import RetryAfter, add_band, classified, retry_after_of
from xds_server.envoy._route_matches import by_model, group_name
from xds_server.envoy._route_tenants import with_tenants
from xds_server.envoy._route_to_pools import (
    MAX_SESSION_KEY_CHARS,
    PREVIOUS_HOSTS_PREDICATE,
    PROMPT_PREFIX_REGEX,
    RETRY_ON,
    SESSION_KEY_REGEX,
    route_action,
    split,
    split_pools,
    to_pool,
)
from xds_server.errors import ResourceBuildError

__all__ = [
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

# Envoy refuses these in header values (HTTP_HEADER_VALUE), and routed requests carry the
# model name in names.ROUTED_MODEL_HEADER.
_HEADER_UNSAFE = frozenset("\r\n\0")

# The route kinds of routes 1 and 2 (module docstring), in that order: the body names the
# model, or only the listener's model header does.
_KINDS = ("model", "header")

# A pool's model or LoRA adapter that is not rewritten: (pool, model, is an adapter).
_Served = tuple[PoolConfig, str, bool]


def build_routes(
    config: RoutingConfig,
    retry_after: Mapping[tuple[str, Band], int] | None = None,
    *,
    envoys: int = 1,
) -> list[_Any]:
    """The route configurations for `config`: the listener's, named names.ROUTE_CONFIG_NAME,
    then one per spill listener (build_spill_routes), in config order.

    `retry_after` gives, per (pool name, band), the seconds a refused request of that band
    is told to wait (the policy's expected drain time); a pair it lacks, or None, gets
    `flow_control.retry_after_min_s`. Values are kept within the config's bounds. Used only
    when flow control is enabled. `envoys` is the number of Envoys each tenant's request
    rate is split over (_tenant_limits.py).

    Raises ResourceBuildError when a pool serves a model named like a sentinel (names.SENTINELS),
    which the routes could not tell apart from a request without a model, or a model
    whose name cannot be a header value (Envoy would reject the whole route config).
    """
    served = _served(config)
    _check_model_names(config, served)
    waits = RetryAfter(config, retry_after or {})
    paths = answers.forwarded_paths(config)
    header = config.listener.model_header
    routes = [
        *answers.wrong_methods(paths),
        *_model_routes(config, served, waits),
        *answers.unserved_paths(config, header),
        *answers.model_refusals(header, paths),
        *answers.model_paths(config),
        answers.not_found(),
        _unrouted(),
    ]
    spills = [build_spill_routes(config, pool) for pool in config.pools if config.spills(pool)]
    return [_listener_routes(config, routes, envoys), *spills]


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
        action = route_action(config, cluster, adapter, adapter=True, hashed=False)
        routes.append(rc_pb2.Route(name=f"spill/{adapter}", match=match, route=action))
    action = route_action(config, cluster, "", adapter=False, hashed=False)
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


def _served(config: RoutingConfig) -> list[_Served]:
    """Every model and adapter of every pool, in config order, but the rewritten ones
    (their splits serve them)."""
    rewritten = {r.model for r in config.model_rewrites}
    return [
        (pool, model, model in pool.adapters)
        for pool in config.pools
        for model in (*pool.models, *pool.adapters)
        if model not in rewritten
    ]


def _check_model_names(config: RoutingConfig, served: list[_Served]) -> None:
    """Raise ResourceBuildError for a served model named like a sentinel, or a served or
    rewritten model with a character a header value cannot carry."""
    models = [model for _, model, _ in served]
    rewritten = {r.model for r in config.model_rewrites}
    _refuse(
        "model names reserved by the gateway", sorted(m for m in models if m in names.SENTINELS)
    )
    _refuse("model names with CR, LF or NUL", sorted(map(repr, filter(_unsendable, models))))
    _refuse(
        "rewritten model names with CR, LF or NUL",
        sorted(map(repr, filter(_unsendable, rewritten))),
    )


def _unsendable(model: str) -> bool:
    """Whether `model` cannot be a header value."""
    return bool(_HEADER_UNSAFE.intersection(model))


def _refuse(what: str, found: list[str]) -> None:
    """Raise ResourceBuildError naming the `found` `what`, if any."""
    if found:
        raise ResourceBuildError(f"{what}: {', '.join(found)}")


def _model_routes(
    config: RoutingConfig, served: list[_Served], waits: RetryAfter
) -> Iterator[_Any]:
    """Routes 1 and 2 (module docstring): per kind, the splits, then the served models."""
    for kind in _KINDS:
        yield from _split_routes(config, kind, waits)
        yield from _served_routes(config, served, kind, waits)


def _split_routes(config: RoutingConfig, kind: str, waits: RetryAfter) -> Iterator[_Any]:
    """`split-<kind>/<model>` of each rewritten model (per band with flow control)."""
    header = config.listener.model_header
    for rewrite in config.model_rewrites:
        paths = paths_of(config.rewrite_api(rewrite))
        matches = by_model(header, rewrite.model, kind=kind, paths=paths)
        for index, match in enumerate(matches):
            for suffix, band, banded in _bands(config, rewrite.model, match):
                route = split(config, rewrite, kind=kind, match=banded, band=band)
                route.name = group_name(route.name + suffix, index)
                if band is not None:
                    pools = split_pools(config, rewrite)
                    # The client waits for the slowest pool rather than retrying too soon.
                    wait = max(waits.of(pool, band) for pool in pools)
                    add_band(route, band, " or ".join(pools), wait)
                yield from with_tenants(config, band, [route])


def _served_routes(
    config: RoutingConfig, served: list[_Served], kind: str, waits: RetryAfter
) -> Iterator[_Any]:
    """The routes of each served model to its pool (per band with flow control)."""
    header = config.listener.model_header
    for pool, model, adapter in served:
        matches = by_model(header, model, kind=kind, paths=paths_of(pool.api))
        for index, match in enumerate(matches):
            for suffix, band, banded in _bands(config, model, match):
                routes = to_pool(
                    config, pool, model, adapter=adapter, kind=kind, match=banded, band=band
                )
                for route in routes:
                    route.name = group_name(route.name + suffix, index)
                    if band is not None:
                        add_band(route, band, pool.name, waits.of(pool.name, band))
                yield from with_tenants(config, band, routes)


def _bands(
    config: RoutingConfig, model: str, match: _Any
) -> Iterator[tuple[str, Band | None, _Any]]:
    """(route name suffix, band, match) of each classification route of `model`'s `match`
    with flow control (_route_bands.classified); without, `match` alone, with no band."""
    if not config.flow_control.enabled:
        yield "", None, match
        return
    yield from classified(config, model, match)


def _unrouted() -> _Any:
    """Route 10 (module docstring): a request json_to_metadata has not read, to a cluster
    that never exists."""
    return rc_pb2.Route(
        name="unrouted",
        match=rc_pb2.RouteMatch(prefix="/"),
        route=rc_pb2.RouteAction(
            cluster=names.UNROUTED_CLUSTER,
            cluster_not_found_response_code=rc_pb2.RouteAction.INTERNAL_SERVER_ERROR,
        ),
    )


def _listener_routes(config: RoutingConfig, routes: list[_Any], envoys: int) -> _Any:
    """The listener's route configuration: `routes` in one catch-all virtual host."""
    virtual_host = rc_pb2.VirtualHost(
        name=names.VIRTUAL_HOST_NAME,
        domains=["*"],
        routes=routes,
        # Replaces the deprecated per_request_buffer_limit_bytes (both work on 1.40).
        request_body_buffer_limit=wrappers_pb2.UInt64Value(value=config.listener.max_request_bytes),
    )
    # Every route inherits the tenants' rate limits (_tenant_limits.py).
    _tenant_limits.configure_virtual_host(virtual_host, config.flow_control.tenants, envoys)
    return route_pb2.RouteConfiguration(
        name=names.ROUTE_CONFIG_NAME,
        virtual_hosts=[virtual_host],
        # Routes may name a pool's cluster before CDS has it, and the unrouted cluster
        # never exists (RDS defaults to false already; inline configs to true).
        validate_clusters=wrappers_pb2.BoolValue(value=False),
        # The model list grows with the models; Envoy refuses a larger body.
        max_direct_response_body_size_bytes=wrappers_pb2.UInt32Value(
            value=answers.direct_response_bytes(routes)
        ),
    )
