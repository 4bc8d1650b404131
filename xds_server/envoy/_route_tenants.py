"""Weighted tenants' lanes in the routes (routes.py's docstring, "Flow control"): before
each group of a limited band's routes, one variant per weighted tenant of each route to
the pool's own lane, matching the tenant and sent to its lane's cluster, whose circuit
breaker is the tenant's share of the band (clusters.py, policy/tenant_shares.py).

The variants come first in the group, so all of a weighted tenant's requests of the band
take its lane: a session key or a long prompt does not move them to the shared lanes
(where they would escape the tenant's share). A weighted tenant's requests are therefore
balanced by load only: no session affinity, no long-prompt lane.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any as _Any

from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.type.matcher.v3 import string_pb2

from xds_server.config import TENANT_BANDS, Band, RoutingConfig
from xds_server.envoy import _tenant_limits, names
from xds_server.envoy._route_matches import metadata_matcher, string, with_header

__all__ = ["with_tenants"]


def with_tenants(
    config: RoutingConfig, band: Band | None, routes: Iterable[_Any]
) -> Iterator[_Any]:
    """`routes` (one band's group, for one match), preceded by each weighted tenant's
    variants of those to the pool's own lane (a split's: to its pools' own lanes); `routes`
    alone without flow control, for a band without tenant lanes, or without weighted
    tenants."""
    routes = list(routes)
    tenants = config.flow_control.tenants
    weighted = tenants.weighted()
    if band is None or band not in TENANT_BANDS or not weighted or not config.flow_control.enabled:
        yield from routes
        return
    own_lanes = {names.band_cluster_name(pool.name, band): pool.name for pool in config.pools}
    for tenant in weighted:
        for route in routes:
            variant = _variant(route, tenant, band, own_lanes)
            if variant is not None:
                variant.match.CopyFrom(_for_tenant(config, variant.match, tenant))
                yield variant
    yield from routes


def _variant(route: _Any, tenant: str, band: Band, own_lanes: dict[str, str]) -> _Any | None:
    """A copy of `route` to `tenant`'s lanes, named `<name>/t/<tenant>`, when every cluster
    it sends to is a pool's own lane of `band` (None otherwise)."""
    action = route.route
    if action.HasField("weighted_clusters"):
        targets = [weighted.name for weighted in action.weighted_clusters.clusters]
    else:
        targets = [action.cluster]
    if not targets or not all(target in own_lanes for target in targets):
        return None
    variant = rc_pb2.Route()
    variant.CopyFrom(route)
    variant.name = f"{route.name}{names.TENANT_CLUSTER_INFIX}{tenant}"
    if action.HasField("weighted_clusters"):
        for weighted in variant.route.weighted_clusters.clusters:
            weighted.name = names.tenant_cluster_name(own_lanes[weighted.name], band, tenant)
    else:
        variant.route.cluster = names.tenant_cluster_name(own_lanes[action.cluster], band, tenant)
    variant.metadata.filter_metadata[names.METADATA_NAMESPACE][_tenant_limits.TENANT_KEY] = tenant
    return variant


def _for_tenant(config: RoutingConfig, match: _Any, tenant: str) -> _Any:
    """`match`, narrowed to the requests of `tenant` (its header, or `llm:tenant`)."""
    tenants = config.flow_control.tenants
    if tenants.header is not None:
        exact = string_pb2.StringMatcher(exact=tenant)
        return with_header(match, rc_pb2.HeaderMatcher(name=tenants.header, string_match=exact))
    narrowed = rc_pb2.RouteMatch()
    narrowed.CopyFrom(match)
    narrowed.dynamic_metadata.append(
        metadata_matcher(_tenant_limits.TENANT_KEY, string(exact=tenant))
    )
    return narrowed
