"""Pure: a RoutingConfig (and the policy's Decision) in, Envoy v3 resources out.

No I/O here, and nothing from the xDS server, grpc or aiohttp (import-linter checks
it): the same config always gives the same messages, so they can be serialized once,
hashed into a version, and unit-tested without sockets.
"""

from __future__ import annotations

from xds_server.envoy import names
from xds_server.envoy.bootstrap import render_bootstrap
from xds_server.envoy.clusters import build_cluster, build_clusters, build_session_cluster
from xds_server.envoy.endpoints import build_endpoints, build_pool_endpoints
from xds_server.envoy.listeners import build_http_connection_manager, build_listeners
from xds_server.envoy.routes import build_routes
from xds_server.envoy.runtime import build_runtime

__all__ = [
    "build_cluster",
    "build_clusters",
    "build_endpoints",
    "build_http_connection_manager",
    "build_listeners",
    "build_pool_endpoints",
    "build_routes",
    "build_runtime",
    "build_session_cluster",
    "names",
    "render_bootstrap",
]
