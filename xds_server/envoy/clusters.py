"""One EDS cluster per pool, and the endpoints (ClusterLoadAssignments) that fill them.

Clusters change rarely (a pool added or removed); endpoints and their weights change
often. Keeping endpoints in EDS means a weight update is one small
ClusterLoadAssignment: no cluster rebuild, no connection churn, in-flight requests finish.

Balancing is Envoy's weighted least request: with unequal weights it picks hosts by
`weight / (active_requests + 1)`, so the slow loop (this server) sets weights from GPU
metrics while the fast loop (Envoy) reacts per request to what is in flight.
"""

from __future__ import annotations

from typing import Any as _Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, config_source_pb2, extension_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from google.protobuf import wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.config import EndpointConfig, PoolConfig, RoutingConfig
from xds_server.envoy import _protos, names

__all__ = [
    "LEAST_REQUEST_POLICY",
    "ROUND_ROBIN_POLICY",
    "build_cluster",
    "build_clusters",
    "build_endpoints",
]

LEAST_REQUEST_POLICY = "envoy.load_balancing_policies.least_request"
ROUND_ROBIN_POLICY = "envoy.load_balancing_policies.round_robin"


def build_clusters(config: RoutingConfig) -> list[_Any]:
    """One EDS cluster per pool, in config order, named names.cluster_name(pool)."""
    return [build_cluster(config, pool) for pool in config.pools]


def build_cluster(config: RoutingConfig, pool: PoolConfig) -> _Any:
    """The EDS cluster of `pool`; its endpoints come from build_endpoints over ADS."""
    return cluster_pb2.Cluster(
        name=names.cluster_name(pool.name),
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            ),
            service_name=names.eds_service_name(pool.name),
        ),
        connect_timeout=_protos.duration(config.listener.connect_timeout_s),
        load_balancing_policy=cluster_pb2.LoadBalancingPolicy(
            policies=[cluster_pb2.LoadBalancingPolicy.Policy(typed_extension_config=_policy(pool))]
        ),
        # Upstreams speak HTTP/1.1, Envoy's default: every OpenAI-compatible model
        # server does, and SSE needs nothing more.
    )


def _policy(pool: PoolConfig) -> _Any:
    if pool.balancing == "round_robin":
        return extension_pb2.TypedExtensionConfig(
            name=ROUND_ROBIN_POLICY, typed_config=_protos.pack(round_robin_pb2.RoundRobin())
        )
    return extension_pb2.TypedExtensionConfig(
        name=LEAST_REQUEST_POLICY,
        # Defaults: 2 choices when weights are equal, active_request_bias 1.
        typed_config=_protos.pack(least_request_pb2.LeastRequest()),
    )


def build_endpoints(config: RoutingConfig) -> list[_Any]:
    """One ClusterLoadAssignment per pool, in config order, even for a pool with no
    endpoints (an empty assignment is how EDS says "none": the cluster finishes warming
    and answers 503 instead of waiting for endpoints)."""
    return [
        endpoint_pb2.ClusterLoadAssignment(
            cluster_name=names.eds_service_name(pool.name),
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(
                    lb_endpoints=[_lb_endpoint(e) for e in pool.endpoints]
                )
            ]
            if pool.endpoints
            else [],
        )
        for pool in config.pools
    ]


def _lb_endpoint(endpoint: EndpointConfig) -> _Any:
    return endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(
                    address=endpoint.address, port_value=endpoint.port
                )
            )
        ),
        load_balancing_weight=wrappers_pb2.UInt32Value(value=endpoint.weight),
    )
