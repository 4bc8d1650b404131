"""Turn the builders' xDS resources into a static Envoy bootstrap, for tests that run a
real Envoy without the xDS server: routes go inline into the connection manager
(`route_config` instead of `rds`) and each pool's ClusterLoadAssignment inline into its
cluster (`load_assignment`, type STATIC instead of EDS)."""

from __future__ import annotations

from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf import json_format

from xds_server.config import RoutingConfig
from xds_server.envoy import (
    build_clusters,
    build_endpoints,
    build_listeners,
    build_routes,
    render_bootstrap,
)
from xds_server.policy.decision import Decision

__all__ = ["hcm_of", "static_bootstrap"]


def hcm_of(listener: Any) -> Any:
    """The HttpConnectionManager of `listener`'s only filter chain."""
    hcm = hcm_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def static_bootstrap(config: RoutingConfig, decision: Decision | None = None) -> dict[str, Any]:
    """A bootstrap dict serving `config` from static resources, with the endpoints of
    `decision` (else the config's; admin is left to the caller: EnvoyProcess sets it)."""
    route_configs = {r.name: r for r in build_routes(config)}
    listeners = []
    for listener in build_listeners(config):
        hcm = hcm_of(listener)
        route_config = route_configs[hcm.rds.route_config_name]
        hcm.ClearField("rds")
        hcm.route_config.CopyFrom(route_config)
        listener.filter_chains[0].filters[0].typed_config.Pack(hcm)
        listeners.append(listener)
    assignments = {cla.cluster_name: cla for cla in build_endpoints(config, decision)}
    clusters = []
    for cluster in build_clusters(config):
        cla = assignments[cluster.eds_cluster_config.service_name]
        cluster.ClearField("eds_cluster_config")
        cluster.type = cluster_pb2.Cluster.STATIC
        cluster.load_assignment.CopyFrom(cla)
        cluster.load_assignment.cluster_name = cluster.name
        clusters.append(cluster)
    return {
        "bootstrap_extensions": render_bootstrap(
            xds_address="127.0.0.1",
            xds_port=1,
            node_id="static",
            node_cluster="static",
            admin_port=0,
        )["bootstrap_extensions"],
        "static_resources": {
            "listeners": [_to_dict(m) for m in listeners],
            "clusters": [_to_dict(m) for m in clusters],
        },
    }


def _to_dict(message: Any) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result
