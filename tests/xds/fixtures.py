"""Small, hand-made resources for protocol tests: they exercise the wire, not routing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, config_source_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import api_listener_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2
from google.protobuf.wrappers_pb2 import UInt32Value

from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

ADS = config_source_pb2.ConfigSource(
    ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3
)


def cluster(name: str, *, connect_timeout_ms: int = 1000) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=ADS, service_name=name),
        connect_timeout=duration_pb2.Duration(
            seconds=connect_timeout_ms // 1000, nanos=connect_timeout_ms % 1000 * 1_000_000
        ),
    )


def assignment(
    name: str, endpoints: Sequence[tuple[str, int, int]]
) -> endpoint_pb2.ClusterLoadAssignment:
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                lb_endpoints=[
                    endpoint_components_pb2.LbEndpoint(
                        endpoint=endpoint_components_pb2.Endpoint(
                            address=address_pb2.Address(
                                socket_address=address_pb2.SocketAddress(
                                    address=host, port_value=port
                                )
                            )
                        ),
                        load_balancing_weight=UInt32Value(value=weight),
                    )
                    for host, port, weight in endpoints
                ]
            )
        ],
    )


def api_listener(name: str, route_name: str) -> listener_pb2.Listener:
    hcm = hcm_pb2.HttpConnectionManager(
        rds=hcm_pb2.Rds(config_source=ADS, route_config_name=route_name),
        http_filters=[hcm_pb2.HttpFilter(name="envoy.filters.http.router")],
    )
    packed = any_pb2.Any()
    packed.Pack(hcm)
    return listener_pb2.Listener(
        name=name, api_listener=api_listener_pb2.ApiListener(api_listener=packed)
    )


def route_config(name: str, cluster_name: str) -> route_pb2.RouteConfiguration:
    return route_pb2.RouteConfiguration(
        name=name,
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name="all",
                domains=["*"],
                routes=[
                    route_components_pb2.Route(
                        match=route_components_pb2.RouteMatch(prefix="/"),
                        route=route_components_pb2.RouteAction(cluster=cluster_name),
                    )
                ],
            )
        ],
    )


RUNTIME_LAYER = "layer"


def runtime(layer: Mapping[str, float], *, name: str = RUNTIME_LAYER) -> rtds_pb2.Runtime:
    struct = struct_pb2.Struct()
    struct.update(dict(layer))
    return rtds_pb2.Runtime(name=name, layer=struct)


def snapshot(
    pools: Mapping[str, Sequence[tuple[str, int, int]]],
    *,
    listeners: Mapping[str, str] | None = None,
    connect_timeout_ms: int = 1000,
    runtime_layer: Mapping[str, float] | None = None,
) -> Snapshot:
    """Clusters and assignments per pool; `listeners` maps listener name -> pool it routes to.

    With `runtime_layer`, also the Runtime resource RUNTIME_LAYER holding it.
    """
    listeners = listeners or {}
    return Snapshot.build(
        {
            ResourceType.RUNTIME: [] if runtime_layer is None else [runtime(runtime_layer)],
            ResourceType.CLUSTER: [
                cluster(n, connect_timeout_ms=connect_timeout_ms) for n in pools
            ],
            ResourceType.ENDPOINT: [assignment(n, eps) for n, eps in pools.items()],
            ResourceType.LISTENER: [api_listener(n, f"route-{n}") for n in listeners],
            ResourceType.ROUTE: [route_config(f"route-{n}", pool) for n, pool in listeners.items()],
        }
    )
