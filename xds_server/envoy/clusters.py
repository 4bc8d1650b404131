"""The EDS clusters of every pool: how Envoy picks an endpoint for each request.

Clusters change rarely (a pool added, removed or re-tuned); endpoints and their weights
change often and live in EDS (endpoints.py), so a weight update is one small
ClusterLoadAssignment: no cluster rebuild, no connection churn, in-flight requests finish.

A pool with `remotes` reached over TLS gets one transport socket match per such remote
(`envoy.transport_socket_match: {remote: name}` on its endpoints, endpoints.py): an
UpstreamTlsContext with its SNI, CA and, when given, a client certificate; the pool's
own pods match none and stay plaintext.

Per pool, one cluster named after it:

- Weighted least request (or round robin when the pool asks for it). With unequal weights
  Envoy picks hosts by `weight / (active_requests + 1)`, so the slow loop (this server)
  sets weights from GPU metrics while the fast loop (Envoy) reacts per request to what is
  in flight.
- `healthy_panic_threshold` 0. By default, when under 50% of a pool's hosts are healthy
  Envoy "panics" and spreads traffic over all hosts, unhealthy ones included: with GPU
  pods, the ones the policy took out (stale metrics) would get traffic exactly when most
  of the pool is in trouble. 0 turns panic off: only healthy hosts, or a 503 when none is.
- Failing pods (config.upstream): outlier detection ejects a pod after consecutive
  local-origin failures (connect failures, resets, timeouts; not HTTP 5xx answers, which a
  bad request can cause on a healthy pod), at most `max_ejection_percent` of a pool; the
  circuit breaker's limits are the config's, not Envoy's built-in 1,024 requests, and its
  retry budget bounds the retries the routes make (routes.py). Every cluster of the pool
  (session, long-prompt, band) gets the same.
- A pool with LoRA `adapters` wraps the policy in the subset load balancer: endpoint
  metadata `envoy.lb: {lora: [adapters held]}` (endpoints.py) with `list_as_any` makes
  one subset per adapter; a route for adapter A asks for `lora == A` (routes.py) and gets
  A's holders, balanced by the same child policy. When no healthy pod holds A, or a
  request names no adapter, the fallback ANY_ENDPOINT balances over the whole pool.

A pool with `session_affinity` gets a second cluster, names.session_cluster_name(pool), on
its own ClusterLoadAssignment, names.session_eds_service_name(pool): the same endpoints,
health and adapters, weighted by capacity instead of load. Maglev consistent hashing on
the route's hash policy (the session key) sizes each host's share of the table by its
weight, and a weight that followed load would move keys away from their cached prefixes
with every update. Load reaches it through the spill: a pod that queues by its metrics
(all traffic counted, not only keyed) spills (endpoints.py, `spilling`): its entry in the
table points at the pool's spill listener (listeners.py), which balances its keys'
requests over the pool's cluster until it recovers, while the other keys stay put.
Envoy's bounded load (`hash_balance_factor`, off by default) would skip a host over a
multiple of the mean in-flight load of this cluster at one Envoy: a pod against the
others, not against its own room, so on scenario c it moved keys off pods that had room.
Requests without a session key never reach it. A pool that keeps its keys in buckets
(`balancing.key_homes` "buckets") has no Maglev there: the subset balancer picks by the
request's key bucket (`_key_bucket_subsets`).

A GPU-aware pool (weights from metrics) also gets a cluster for its long prompts,
`<pool>/long` (`balancing.long_prompt_bytes`; routes.py sends them there): a copy of the
pool's cluster on the same ClusterLoadAssignment, so the same endpoints, weights and
balancing. It exists so that the Envoys' load reports (LRS, per endpoint) count long
prompts apart: the policy then knows which pods are busy with a long prefill, seconds
before their metrics show the requests queued behind it, and cuts their weight.

With flow control on, each pool also gets one cluster per band and lane (config.lanes),
names.band_cluster_name(pool, band, lane): copies of the pool's cluster (or session or
long-prompt cluster), so the same balancing, subsets, upstream settings and
ClusterLoadAssignment, plus a circuit breaker whose `max_requests` is the band's admission
limit. Its static value is only a ceiling (BAND_MAX_REQUESTS); the limit itself comes from
the runtime key `circuit_breakers.<cluster>.default.max_requests` (RTDS), which Envoy applies
at once without touching the cluster: a CDS update would drop its idle connections and
restart its counts. A request over the limit is refused before it reaches a model server
(response flag UO), which the listener turns into a 429 (listeners.py). Session-keyed
requests and long prompts are admitted per band too, by their own clusters (neither a
session key nor a long prompt is a way around the limit), so a band's budget spans a
counter per lane.

With weighted tenants (`flow_control.tenants.named.<tenant>.weight`), each of them also has
a lane of its own in each limited band (config.TENANT_BANDS), names.tenant_cluster_name:
a copy of the band's cluster in the pool's own lane (weighted least request; a tenant's
requests are not hashed to a session nor put apart as long prompts), whose circuit
breaker, set at runtime like the band's, is that tenant's fair share of the band
(policy/tenant_shares.py). These grow as pools × 2 bands × weighted tenants: for a bounded
list of tenants.
"""

from __future__ import annotations

from typing import Any as _Any

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, extension_pb2
from envoy.extensions.load_balancing_policies.common.v3 import common_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.maglev.v3 import maglev_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.extensions.load_balancing_policies.subset.v3 import subset_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as tls_common_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.type.matcher.v3 import string_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import struct_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.config import BANDS, BalancingConfig, Lane, PoolConfig, RemoteConfig, RoutingConfig
from xds_server.envoy import _protos, names
from xds_server.maglev import RING_SPILL_TABLE_SIZE, table_size

__all__ = [
    "BAND_MAX_REQUESTS",
    "LEAST_REQUEST_POLICY",
    "MAGLEV_POLICY",
    "ROUND_ROBIN_POLICY",
    "SUBSET_POLICY",
    "build_band_clusters",
    "build_cluster",
    "build_clusters",
    "build_session_cluster",
    "build_tenant_clusters",
]

LEAST_REQUEST_POLICY = "envoy.load_balancing_policies.least_request"
ROUND_ROBIN_POLICY = "envoy.load_balancing_policies.round_robin"
MAGLEV_POLICY = "envoy.load_balancing_policies.maglev"
SUBSET_POLICY = "envoy.load_balancing_policies.subset"

# The static circuit breaker limits of a band cluster: high enough never to bind, so the
# runtime key alone (or nothing, before the policy sets one) decides admission. Pending
# requests and connections are not limited: HTTP/1.1 upstream requests wait in pending while
# a connection opens, so a small pending limit would refuse requests the band admits.
BAND_MAX_REQUESTS = 1_000_000


def build_clusters(config: RoutingConfig) -> list[_Any]:
    """Per pool in config order: one cluster per lane (the pool's, its session cluster with
    session affinity, its long-prompt cluster), then its band clusters with flow control."""
    clusters = []
    for pool in config.pools:
        clusters += [_lane_cluster(config, pool, lane) for lane in config.lanes(pool)]
        if config.flow_control.enabled:
            clusters += build_band_clusters(config, pool)
            clusters += build_tenant_clusters(config, pool)
    return clusters


def build_tenant_clusters(config: RoutingConfig, pool: PoolConfig) -> list[_Any]:
    """The lanes of `pool`'s weighted tenants (module docstring): per band of
    config.TENANT_BANDS and tenant (sorted), a copy of the band's cluster in the pool's own
    lane under the tenant's name (names.tenant_cluster_name)."""
    clusters = []
    base = build_cluster(config, pool)
    for lanes in names.tenant_clusters(config, pool).values():
        for cluster_name in lanes.values():
            cluster = cluster_pb2.Cluster()
            cluster.CopyFrom(base)
            cluster.name = cluster_name
            cluster.circuit_breakers.CopyFrom(_band_circuit_breakers(config))
            clusters.append(cluster)
    return clusters


def build_band_clusters(config: RoutingConfig, pool: PoolConfig) -> list[_Any]:
    """The band clusters of `pool` (module docstring): per lane (config.lanes), critical
    first."""
    clusters = []
    for lane in config.lanes(pool):
        base = _lane_cluster(config, pool, lane)
        for band in BANDS:
            cluster = cluster_pb2.Cluster()
            cluster.CopyFrom(base)
            cluster.name = names.band_cluster_name(pool.name, band, lane)
            cluster.circuit_breakers.CopyFrom(_band_circuit_breakers(config))
            clusters.append(cluster)
    return clusters


def _lane_cluster(config: RoutingConfig, pool: PoolConfig, lane: Lane) -> _Any:
    if lane == "session":
        return build_session_cluster(config, pool)
    return build_cluster(config, pool, long_prompts=lane == "long")


def _band_circuit_breakers(config: RoutingConfig) -> _Any:
    return _circuit_breakers(
        config,
        max_requests=BAND_MAX_REQUESTS,
        max_pending_requests=BAND_MAX_REQUESTS,
        max_connections=BAND_MAX_REQUESTS,
    )


def _circuit_breakers(
    config: RoutingConfig, *, max_requests: int, max_pending_requests: int, max_connections: int
) -> _Any:
    """The default-priority thresholds, with the retry budget (config.upstream): retries in
    flight at most a share of the requests in flight, so they cannot amplify an overload."""
    upstream = config.upstream
    thresholds = circuit_breaker_pb2.CircuitBreakers.Thresholds
    return circuit_breaker_pb2.CircuitBreakers(
        thresholds=[
            thresholds(
                priority=base_pb2.DEFAULT,
                max_requests=_protos.uint32(max_requests),
                max_pending_requests=_protos.uint32(max_pending_requests),
                max_connections=_protos.uint32(max_connections),
                retry_budget=thresholds.RetryBudget(
                    budget_percent=percent_pb2.Percent(value=upstream.retry_budget_percent),
                    min_retry_concurrency=_protos.uint32(upstream.min_retry_concurrency),
                ),
                # circuit_breakers.default.remaining_rq in stats: what the cluster has left.
                track_remaining=True,
            )
        ]
    )


def _outlier_detection(config: RoutingConfig) -> _Any:
    """Ejection on local-origin failures only (connect failures, resets, timeouts: the pod
    is gone or stuck), not on HTTP 5xx answers, which a bad request can cause on a healthy
    pod. Each Envoy ejects at once on the Nth failure in a row, before this server has seen
    the pod fail a scrape; success-rate ejection is off (it needs request volume a GPU pod
    does not have, and would fight the policy's weights)."""
    upstream = config.upstream
    return outlier_detection_pb2.OutlierDetection(
        split_external_local_origin_errors=True,
        consecutive_local_origin_failure=_protos.uint32(upstream.eject_after_failures),
        enforcing_consecutive_local_origin_failure=_protos.uint32(100),
        enforcing_consecutive_5xx=_protos.uint32(0),
        enforcing_consecutive_gateway_failure=_protos.uint32(0),
        enforcing_success_rate=_protos.uint32(0),
        enforcing_local_origin_success_rate=_protos.uint32(0),
        enforcing_failure_percentage=_protos.uint32(0),
        enforcing_failure_percentage_local_origin=_protos.uint32(0),
        interval=_protos.duration(1.0),
        base_ejection_time=_protos.duration(upstream.ejection_s),
        max_ejection_time=_protos.duration(max(upstream.ejection_s, upstream.max_ejection_s)),
        max_ejection_percent=_protos.uint32(upstream.max_ejection_percent),
    )


def build_cluster(config: RoutingConfig, pool: PoolConfig, *, long_prompts: bool = False) -> _Any:
    """The EDS cluster of `pool`, named names.cluster_name(pool): weighted least request
    (or round robin), inside a subset balancer when the pool has LoRA adapters. With
    `long_prompts`, the same cluster named for the pool's long prompts (`<pool>/long`)."""
    return _eds_cluster(
        config,
        pool,
        names.lane_cluster_name(pool.name, "long" if long_prompts else "pool"),
        _balancing(config, pool),
        service_name=names.eds_service_name(pool.name),
    )


def build_session_cluster(config: RoutingConfig, pool: PoolConfig) -> _Any:
    """The session-affinity cluster of `pool`, named names.session_cluster_name(pool):
    Maglev consistent hashing with bounded load on the pool's session
    ClusterLoadAssignment (the same endpoints, weighted by capacity rather than load:
    names.session_eds_service_name).

    Maglev, not ring hash: with `balancing.spill_to` "ring", a pod that queues leaves the
    session assignment's healthy set for a while (endpoints.py, `spilling`), and its keys
    must go to other pods without moving theirs. Ring hash rebuilds its ring with more
    points per remaining host, so about one key in eight of the other pods moved too (4
    pods, simulated); Maglev's table keeps the other pods' entries (0.05% moved) and takes
    them back on return (with Envoy's table of 65,537 slots, which `spill_to: ring` keeps;
    maglev.py). It hashes each endpoint's hostname, its name (endpoints.py), not its
    address. With `spill_to: pool` (the pod stays in the table) its table size is
    maglev.table_size's for the pool: the server builds the same table to know where each
    key goes (homes.py). A pool that keeps its keys in buckets (config.bucket_homes) gets
    `_key_bucket_subsets` instead."""
    spills_by_leaving = config.balancing.spill_to == "ring"
    size = RING_SPILL_TABLE_SIZE if spills_by_leaving else table_size(len(pool.endpoints))
    maglev = extension_pb2.TypedExtensionConfig(
        name=MAGLEV_POLICY,
        typed_config=_protos.pack(
            maglev_pb2.Maglev(
                table_size=_protos.uint64(size),
                consistent_hashing_lb_config=_consistent_hashing(config.balancing),
            )
        ),
    )
    if config.bucket_homes(pool):
        policy = _key_bucket_subsets(_least_request(full_scan=True))
    else:
        policy = _subset(config, pool, maglev)
    return _eds_cluster(
        config,
        pool,
        names.session_cluster_name(pool.name),
        policy,
        service_name=names.session_eds_service_name(pool.name),
    )


def _least_request(*, full_scan: bool = False) -> _Any:
    """Envoy's least request: by default two random choices (active_request_bias 1); with
    `full_scan`, the host with the fewest requests in flight of all."""
    policy = least_request_pb2.LeastRequest()
    if full_scan:
        policy.selection_method = least_request_pb2.LeastRequest.FULL_SCAN
    return extension_pb2.TypedExtensionConfig(
        name=LEAST_REQUEST_POLICY, typed_config=_protos.pack(policy)
    )


def _key_bucket_subsets(child: _Any) -> _Any:
    """A bucketed session cluster (`key_homes: buckets`): one subset per key bucket, made
    of the endpoints whose `key_bucket` list holds it (endpoints.py: the pod it is pinned
    or offered to at priority 0, the pod's stand-in at the spill listener at priority 1),
    picked by the request's bucket (listeners.py); a bucket no endpoint lists (between
    two pushes) goes to the default subset, the `key_spare` pods, where `child` picks the
    one with the fewest requests in flight. A bucket offered to several spares is such a
    subset too: `child` scans them all (least request's full scan), so that new keys that
    arrive together go to different pods, where two random choices miss the least busy of
    three spares four times in nine (tests/e2e/test_key_buckets.py).

    `child` is least request, not Maglev: Envoy's hashing balancers pick the priority by
    the key's hash alone, so a retry of a request whose pod just died drew the same pod
    again until its ejection had reached the subset's table (probed on Envoy 1.40: one
    request in three to a dead pod failed all three attempts). Least request honours the
    routes' `previous_priorities` (routes.py): the retry goes to priority 1, the pool."""
    subset = subset_pb2.Subset
    default = struct_pb2.Struct()
    default.update({names.KEY_SPARE_KEY: True})
    return extension_pb2.TypedExtensionConfig(
        name=SUBSET_POLICY,
        typed_config=_protos.pack(
            subset(
                subset_selectors=[subset.LbSubsetSelector(keys=[names.KEY_BUCKET_KEY])],
                list_as_any=True,
                fallback_policy=subset.DEFAULT_SUBSET,
                default_subset=default,
                subset_lb_policy=cluster_pb2.LoadBalancingPolicy(
                    policies=[cluster_pb2.LoadBalancingPolicy.Policy(typed_extension_config=child)]
                ),
            )
        ),
    )


def _consistent_hashing(balancing: BalancingConfig) -> _Any:
    """Endpoints hashed by name; Envoy's bounded load only where it is set (unset: off)."""
    hashing = common_pb2.ConsistentHashingLbConfig(use_hostname_for_hashing=True)
    if balancing.hash_balance_factor is not None:
        hashing.hash_balance_factor.value = balancing.hash_balance_factor
    return hashing


def _eds_cluster(
    config: RoutingConfig, pool: PoolConfig, name: str, policy: _Any, *, service_name: str
) -> _Any:
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            ),
            service_name=service_name,
        ),
        connect_timeout=_protos.duration(config.listener.connect_timeout_s),
        load_balancing_policy=cluster_pb2.LoadBalancingPolicy(
            policies=[cluster_pb2.LoadBalancingPolicy.Policy(typed_extension_config=policy)]
        ),
        # Never spread traffic to hosts the policy took out of rotation (module docstring).
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            healthy_panic_threshold=percent_pb2.Percent(value=0.0)
        ),
        # Set, not Envoy's built-in 1,024 requests: the limits are the config's.
        circuit_breakers=_circuit_breakers(
            config,
            max_requests=config.upstream.max_requests,
            max_pending_requests=config.upstream.max_pending_requests,
            max_connections=config.upstream.max_connections,
        ),
        outlier_detection=_outlier_detection(config),
        # Upstreams speak HTTP/1.1, Envoy's default: every OpenAI-compatible model
        # server does, and SSE needs nothing more.
    )
    for remote in pool.remotes:
        if remote.tls is not None:
            cluster.transport_socket_matches.append(_remote_tls(remote))
    return cluster


def _remote_tls(remote: RemoteConfig) -> _Any:
    """TLS to `remote`'s gateway for the endpoints that name it (endpoints.py's
    `envoy.transport_socket_match`): SNI, the CA its certificate must chain to, that
    certificate's DNS name, and a client certificate when configured. Local pods match
    none and keep the cluster's plaintext."""
    tls = remote.tls
    assert tls is not None
    common = tls_pb2.CommonTlsContext(
        validation_context=tls_common_pb2.CertificateValidationContext(
            trusted_ca=base_pb2.DataSource(filename=tls.ca_file),
            match_typed_subject_alt_names=[
                tls_common_pb2.SubjectAltNameMatcher(
                    san_type=tls_common_pb2.SubjectAltNameMatcher.DNS,
                    matcher=string_pb2.StringMatcher(exact=tls.sni),
                )
            ],
        )
    )
    if tls.cert_file is not None and tls.key_file is not None:
        common.tls_certificates.append(
            tls_common_pb2.TlsCertificate(
                certificate_chain=base_pb2.DataSource(filename=tls.cert_file),
                private_key=base_pb2.DataSource(filename=tls.key_file),
            )
        )
    match = struct_pb2.Struct()
    match.update({names.REMOTE_KEY: remote.name})
    return cluster_pb2.Cluster.TransportSocketMatch(
        name=f"remote-{remote.name}",
        match=match,
        transport_socket=base_pb2.TransportSocket(
            name="envoy.transport_sockets.tls",
            typed_config=_protos.pack(
                tls_pb2.UpstreamTlsContext(common_tls_context=common, sni=tls.sni)
            ),
        ),
    )


def _balancing(config: RoutingConfig, pool: PoolConfig) -> _Any:
    bias = config.balancing.active_request_bias if pool.weights_from_metrics else 1.0
    if pool.balancing == "round_robin" or bias == 0:
        # Round robin, weighted by EDF when the weights differ: what least request does
        # with active_request_bias 0, except that equal weights stay plain round robin.
        child = extension_pb2.TypedExtensionConfig(
            name=ROUND_ROBIN_POLICY, typed_config=_protos.pack(round_robin_pb2.RoundRobin())
        )
    else:
        least_request = least_request_pb2.LeastRequest()
        if bias != 1.0:
            least_request.active_request_bias.CopyFrom(
                base_pb2.RuntimeDouble(
                    default_value=bias,
                    runtime_key=f"upstream.{pool.name}.least_request.active_request_bias",
                )
            )
        child = extension_pb2.TypedExtensionConfig(
            name=LEAST_REQUEST_POLICY,
            # Defaults: 2 choices when weights are equal, active_request_bias 1.
            typed_config=_protos.pack(least_request),
        )
    return _subset(config, pool, child)


def _subset(config: RoutingConfig, pool: PoolConfig, child: _Any) -> _Any:
    """`child` as is, or inside the subset balancer by LoRA adapter when the pool has any.
    When some pool keeps its keys in buckets, a keyed request's criteria hold its
    `key_bucket` beside the route's `lora` (the router merges the request's `envoy.lb`
    metadata in), which no `[lora]` subset matches: a `[key_bucket, lora]` selector,
    which no endpoint here fills, falls back to the `[lora]` subsets (KEYS_SUBSET).
    Without it a keyed request for an adapter went to any pod
    (bench/results/bucket-homes/probe.py)."""
    if not pool.adapters:
        return child
    subset = subset_pb2.Subset
    selectors = [subset.LbSubsetSelector(keys=[names.LORA_KEY])]
    if any(config.bucket_homes(p) for p in config.pools):
        selectors.append(
            subset.LbSubsetSelector(
                keys=[names.KEY_BUCKET_KEY, names.LORA_KEY],
                fallback_policy=subset.LbSubsetSelector.KEYS_SUBSET,
                fallback_keys_subset=[names.LORA_KEY],
            )
        )
    return extension_pb2.TypedExtensionConfig(
        name=SUBSET_POLICY,
        typed_config=_protos.pack(
            subset(
                subset_selectors=selectors,
                # `lora` is a list: each element makes (or joins) a subset of its own.
                list_as_any=True,
                # A request naming no adapter, or one no healthy pod holds: the whole pool.
                fallback_policy=subset.ANY_ENDPOINT,
                subset_lb_policy=cluster_pb2.LoadBalancingPolicy(
                    policies=[cluster_pb2.LoadBalancingPolicy.Policy(typed_extension_config=child)]
                ),
            )
        ),
    )
