"""Names shared by the resources this package builds, and by whoever reads them back.

Envoy links resources by name: the listener's connection manager asks RDS for
`ROUTE_CONFIG_NAME`, each route names a cluster, and each EDS cluster asks for the
ClusterLoadAssignment named by its `service_name`. Keeping every name here means the
builders, the xDS server and the tests cannot drift apart.

A pool's cluster and its ClusterLoadAssignment are both named after the pool: pool names
are validated DNS-like labels (`config.Name`), so they are valid cluster names, unique,
and readable in `/clusters` and in stats (`cluster.<pool>.upstream_rq_active`).
"""

from __future__ import annotations

__all__ = [
    "ERROR_TYPE",
    "HCM_STAT_PREFIX",
    "LISTENER_NAME",
    "METADATA_NAMESPACE",
    "MODEL_INVALID",
    "MODEL_KEY",
    "MODEL_MISSING",
    "ROUTED_MODEL_HEADER",
    "ROUTE_CONFIG_NAME",
    "SENTINELS",
    "UNROUTED_CLUSTER",
    "VIRTUAL_HOST_NAME",
    "XDS_CLUSTER",
    "cluster_name",
    "eds_service_name",
]

# The one listener that accepts OpenAI-style traffic, and its connection manager's stats
# (`http.llm.downstream_rq_total`, ...).
LISTENER_NAME = "llm_http"
HCM_STAT_PREFIX = "llm"

# The RouteConfiguration the listener asks for over RDS, and its only virtual host.
ROUTE_CONFIG_NAME = "llm_routes"
VIRTUAL_HOST_NAME = "llm"

# Where json_to_metadata writes the request body's `model`: dynamic metadata
# `llm:model`, matched by routes and printed by `%DYNAMIC_METADATA(llm:model)%`.
METADATA_NAMESPACE = "llm"
MODEL_KEY = "model"

# json_to_metadata clears the route cache only when it writes a key, so it must always
# write one: these are written when the body has no `model` (or no body at all) and when
# the body is not JSON. Angle brackets make them unlikely model names; build_routes
# refuses a config that serves a model with one of these names.
MODEL_MISSING = "<missing>"
MODEL_INVALID = "<invalid>"
SENTINELS = frozenset({MODEL_MISSING, MODEL_INVALID})

# Set on every routed request to the model it was routed by, so upstreams (and their
# logs) see it even when the client named the model only in the body; a client-supplied
# value is overwritten.
ROUTED_MODEL_HEADER = "x-gateway-model-name"

# The cluster of the catch-all route that only matches before json_to_metadata has run.
# It never exists: a leading underscore cannot start a pool name. See routes.py.
UNROUTED_CLUSTER = "_unrouted"

# The static cluster in the bootstrap that points at this xDS server.
XDS_CLUSTER = "xds_cluster"

# OpenAI's error `type` for the refusals of a request (not for server-side failures).
ERROR_TYPE = "invalid_request_error"


def cluster_name(pool: str) -> str:
    """The name of the Cluster that serves `pool` (the pool name itself)."""
    return pool


def eds_service_name(pool: str) -> str:
    """The ClusterLoadAssignment name the cluster of `pool` asks EDS for (the pool name)."""
    return pool
