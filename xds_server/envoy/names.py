"""Names shared by the resources this package builds, and by whoever reads them back.

Envoy links resources by name: the listener's connection manager asks RDS for
`ROUTE_CONFIG_NAME`, each route names a cluster, and each EDS cluster asks for the
ClusterLoadAssignment named by its `service_name`. Keeping every name here means the
builders, the xDS server and the tests cannot drift apart.

A pool's cluster and its ClusterLoadAssignment are both named after the pool: pool names
are validated DNS-like labels (`config.Name`), so they are valid cluster names, unique,
and readable in `/clusters` and in stats (`cluster.<pool>.upstream_rq_active`). A pool with
session affinity has a second cluster, `<pool>/session`, on the same assignment: `/` cannot
occur in a pool name, so it never collides with another pool's cluster, and Envoy's stats
keep it whole (`cluster.<pool>/session.upstream_rq_total`; the Prometheus tag
`envoy_cluster_name` is `<pool>/session`). With flow control, each band has its own
clusters on the same assignment too: `<pool>/<band>` and, with session affinity,
`<pool>/session/<band>` (band_cluster_name). A GPU-aware pool's long prompts have a cluster
of their own on the pool's assignment, `<pool>/long` (and `<pool>/long/<band>`), so that the
load reports count them apart: each of these three kinds of cluster is a Lane. A named
tenant with a weight has a lane of its own in each limited band, `<pool>/<band>/t/<tenant>`
(tenant_cluster_name): tenant names cannot hold `:` (config), and `/t/` follows a band,
which no other cluster name has.
"""

from __future__ import annotations

from xds_server.config import BANDS, TENANT_BANDS, Band, Lane, PoolConfig, RoutingConfig

__all__ = [
    "ADAPTER_KEY",
    "BAND_KEY",
    "ERROR_TYPE",
    "HARDWARE_KEY",
    "HCM_STAT_PREFIX",
    "KEY_BUCKET_KEY",
    "KEY_FALLBACK_SUFFIX",
    "KEY_SPARE_KEY",
    "LB_METADATA_NAMESPACE",
    "LISTENER_NAME",
    "LOCAL_SHARE_ADDRESS",
    "LOCAL_SHARE_HOST",
    "LOCAL_SHARE_PORT",
    "LONG_CLUSTER_SUFFIX",
    "LORA_KEY",
    "METADATA_NAMESPACE",
    "MODEL_INVALID",
    "MODEL_KEY",
    "MODEL_MISSING",
    "OBJECTIVE_HEADER",
    "POOL_KEY",
    "RATE_LIMIT_ERROR_TYPE",
    "REMOTE_KEY",
    "REMOTE_ZONE",
    "RETRY_AFTER_KEY",
    "ROUTED_MODEL_HEADER",
    "ROUTE_CONFIG_NAME",
    "RUNTIME_LAYER_NAME",
    "SENTINELS",
    "SESSION_BODY_KEYS",
    "SESSION_CLUSTER_SUFFIX",
    "SESSION_HEADER",
    "SESSION_KEY",
    "SESSION_SOURCE_KEY",
    "SPILL_LISTENER_SUFFIX",
    "TENANT_CLUSTER_INFIX",
    "TRANSPORT_SOCKET_MATCH",
    "UNROUTED_CLUSTER",
    "VIRTUAL_HOST_NAME",
    "XDS_CLUSTER",
    "band_cluster_name",
    "band_clusters",
    "cluster_name",
    "eds_service_name",
    "lane_cluster_name",
    "long_prompt_clusters",
    "session_cluster_name",
    "session_eds_service_name",
    "session_pool",
    "spill_listener_name",
    "tenant_cluster_name",
    "tenant_clusters",
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

# Endpoint metadata the subset load balancer reads (Envoy's own namespace for it): key
# `lora` lists the LoRA adapters an endpoint holds, and a route for adapter A asks for the
# subset `lora == A` through its `metadata_match` (clusters.py, routes.py).
LB_METADATA_NAMESPACE = "envoy.lb"
LORA_KEY = "lora"
# Key buckets (`balancing.key_homes` "buckets"): the listener writes each keyed request's
# bucket, `xxHash64(session header) % key_buckets`, into the request's `envoy.lb` dynamic
# metadata as KEY_BUCKET_KEY (listeners.py); a session assignment's endpoint lists the
# buckets pinned to it under KEY_BUCKET_KEY, and the pods new keys go to carry
# KEY_SPARE_KEY (endpoints.py, clusters.py).
KEY_BUCKET_KEY = "key_bucket"
KEY_SPARE_KEY = "key_spare"
# The `endpoint_id` of a pod's stand-in at priority 1 of a bucketed session assignment:
# the spill listener, which takes the pod's keys while it is out or ejected (endpoints.py).
KEY_FALLBACK_SUFFIX = "#fallback"

# Endpoint metadata for people, not for balancing: under METADATA_NAMESPACE, the hardware
# class (shown by admin /clusters and /config_dump).
HARDWARE_KEY = "hardware"

# Session affinity: the session key is the client's SESSION_HEADER or, without it, the
# body's `prompt_cache_key`, else its `user` (SESSION_BODY_KEYS, first wins), which
# json_to_metadata copies into `llm:session_key` (listeners.py). Route hash policies read
# headers only, so the session routes write that key into SESSION_HEADER (routes.py).
SESSION_HEADER = "x-session-id"
SESSION_BODY_KEYS = ("prompt_cache_key", "user")
SESSION_KEY = "session_key"
SESSION_CLUSTER_SUFFIX = "/session"
# With `balancing.spill_to` "pool", a pod that spills stays in the session assignment
# under its name, its address the pool's internal listener `<pool>/spill` (listeners.py),
# whose routes send the request on to the pool's cluster: the Maglev table does not
# change, and the pod's keys are balanced by load instead of by hash while it spills.
SPILL_LISTENER_SUFFIX = "/spill"

# Failover to other clusters (endpoints.py): the remotes' locality at priority 1, the
# endpoint metadata that picks a remote's TLS (clusters.py's transport socket matches),
# and the placeholder at priority 0 that holds the local share (never in rotation; its
# address is never connected to).
REMOTE_ZONE = "remote"
TRANSPORT_SOCKET_MATCH = "envoy.transport_socket_match"
REMOTE_KEY = "remote"
LOCAL_SHARE_HOST = "local-share"
LOCAL_SHARE_ADDRESS = "127.0.0.1"
LOCAL_SHARE_PORT = 1

# Requests whose content-length says their prompt is long go to `<pool>/long` (routes.py):
# the same endpoints and balancing, counted apart in the load reports, so that the policy
# sees which pods are busy with a long prefill (policy/scoring.py).
LONG_CLUSTER_SUFFIX = "/long"

# Flow control (routes.py): a request names an objective in OBJECTIVE_HEADER (the Gateway
# API Inference Extension's header); each band route carries route metadata under
# METADATA_NAMESPACE with its BAND_KEY, POOL_KEY and RETRY_AFTER_KEY (seconds, a number),
# which the 429 local reply prints (listeners.py).
OBJECTIVE_HEADER = "x-gateway-inference-objective"
BAND_KEY = "band"
POOL_KEY = "pool"
RETRY_AFTER_KEY = "retry_after_s"
# Every route to a pool carries its POOL_KEY; a LoRA adapter's routes the adapter
# (ADAPTER_KEY), a session route where its key comes from (SESSION_SOURCE_KEY: "header",
# "body" or "prompt_prefix", never the key). The access log prints them (access_log.py).
ADAPTER_KEY = "adapter"
SESSION_SOURCE_KEY = "session_key_from"

# Fair shares (docs/flow-control.md "Tenants"): what joins a band's cluster to a tenant
# (config.TENANT_BANDS are the bands with tenant lanes).
TENANT_CLUSTER_INFIX = "/t/"

# The static cluster in the bootstrap that points at this xDS server.
XDS_CLUSTER = "xds_cluster"

# The bootstrap's RTDS layer, and the one Runtime resource the server sends for it
# (runtime.py): Envoy asks RTDS for a layer by its name.
RUNTIME_LAYER_NAME = "xds-server"

# OpenAI's error `type` for the refusals of a request (not for server-side failures).
ERROR_TYPE = "invalid_request_error"
# ... and for a request refused because its band is full (429).
RATE_LIMIT_ERROR_TYPE = "rate_limit_error"


def cluster_name(pool: str) -> str:
    """The name of the Cluster that serves `pool` (the pool name itself)."""
    return pool


def eds_service_name(pool: str) -> str:
    """The ClusterLoadAssignment name the cluster of `pool` asks EDS for (the pool name)."""
    return pool


def session_eds_service_name(pool: str) -> str:
    """The ClusterLoadAssignment of `pool`'s session clusters: the same endpoints on weights
    that follow capacity, not load, so that keys stay where their prefix is cached."""
    return pool + SESSION_CLUSTER_SUFFIX


def session_cluster_name(pool: str) -> str:
    """The consistent-hashing Cluster of `pool` (session affinity), on the pool's endpoints."""
    return pool + SESSION_CLUSTER_SUFFIX


def session_pool(cluster: str) -> str | None:
    """The pool whose session cluster (`<pool>/session` or `<pool>/session/<band>`) is
    `cluster`, or None for any other cluster."""
    pool, _, rest = cluster.partition("/")
    lane, _, band = rest.partition("/")
    if not pool or "/" + lane != SESSION_CLUSTER_SUFFIX or (band and band not in BANDS):
        return None
    return pool


def spill_listener_name(pool: str) -> str:
    """The internal listener that takes the session requests of `pool`'s spilling pods."""
    return pool + SPILL_LISTENER_SUFFIX


def lane_cluster_name(pool: str, lane: Lane) -> str:
    """The Cluster of `pool` for the requests of `lane`: `<pool>`, `<pool>/session` or
    `<pool>/long`."""
    if lane == "session":
        return session_cluster_name(pool)
    return pool + LONG_CLUSTER_SUFFIX if lane == "long" else cluster_name(pool)


def band_cluster_name(pool: str, band: Band, lane: Lane = "pool") -> str:
    """The Cluster that admits `pool`'s requests of `band` (flow control) in `lane`:
    `<pool>/<band>`, `<pool>/session/<band>` or `<pool>/long/<band>`. Its circuit breaker
    is the band's admission limit, runtime key
    `circuit_breakers.<this name>.default.max_requests`."""
    return f"{lane_cluster_name(pool, lane)}/{band}"


def band_clusters(config: RoutingConfig, pool: PoolConfig) -> dict[Band, list[str]]:
    """The clusters that admit each band of `pool` with flow control, one per lane."""
    lanes = config.lanes(pool)
    return {band: [band_cluster_name(pool.name, band, lane) for lane in lanes] for band in BANDS}


def long_prompt_clusters(config: RoutingConfig, pool: PoolConfig) -> list[str]:
    """The clusters that carry `pool`'s long prompts (none without a long-prompt lane)."""
    if "long" not in config.lanes(pool):
        return []
    if config.flow_control.enabled:
        return [band_cluster_name(pool.name, band, "long") for band in BANDS]
    return [lane_cluster_name(pool.name, "long")]


def tenant_cluster_name(pool: str, band: Band, tenant: str) -> str:
    """The Cluster that admits `tenant`'s requests of `pool`'s `band` (its fair share):
    `<pool>/<band>/t/<tenant>`, a copy of the band's cluster in the pool's own lane."""
    return f"{band_cluster_name(pool, band)}{TENANT_CLUSTER_INFIX}{tenant}"


def tenant_clusters(config: RoutingConfig, pool: PoolConfig) -> dict[Band, dict[str, str]]:
    """Per band of TENANT_BANDS, the lane of each weighted tenant by name (none without
    flow control or weighted tenants)."""
    tenants = config.flow_control.tenants.weighted()
    if not config.flow_control.enabled or not tenants:
        return {}
    return {
        band: {tenant: tenant_cluster_name(pool.name, band, tenant) for tenant in tenants}
        for band in TENANT_BANDS
    }
