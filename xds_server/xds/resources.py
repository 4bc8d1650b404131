"""Resource types served over ADS, their type URLs, and what each resource references.

The `ResourceType` order *is* the ADS send order (runtime, clusters, endpoints, listeners,
routes): the xDS protocol asks management servers to send CDS before EDS and LDS before RDS
so that a resource never arrives before the one that needs it is known
(https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol#eventual-consistency-considerations).

Runtime (RTDS) goes first. It references nothing and nothing references it by name, but
runtime keys such as `circuit_breakers.<cluster>.default.max_requests` configure clusters:
sent first, a new cluster's limit is in force before the cluster itself arrives, never the
other way round. It is also the order Envoy itself asks in: it fetches its RTDS layers while
it initializes, before it starts CDS.
"""

from __future__ import annotations

import enum

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf.message import Message

__all__ = ["ResourceType", "name_of", "references_of"]

_HCM = hcm_pb2.HttpConnectionManager


class ResourceType(enum.IntEnum):
    """A resource type, ordered as ADS must send them. NOTE: the order is load-bearing."""

    RUNTIME = 0
    CLUSTER = 1
    ENDPOINT = 2
    LISTENER = 3
    ROUTE = 4

    @property
    def url(self) -> str:
        return str(_URLS[self])

    @property
    def short(self) -> str:
        """The conventional short name (rtds, cds, eds, lds, rds), for logs and metric labels."""
        return _SHORT[self]

    @property
    def message_class(self) -> type[Message]:
        return _CLASSES[self]

    @property
    def dependent(self) -> ResourceType | None:
        """The type whose resources this type's resources reference (CDS → EDS, LDS → RDS)."""
        return _DEPENDENT.get(self)

    @classmethod
    def from_url(cls, url: str) -> ResourceType | None:
        """The type for `url`, or None for a type this server does not serve."""
        return _BY_URL.get(url)


_CLASSES: dict[ResourceType, type[Message]] = {
    ResourceType.RUNTIME: rtds_pb2.Runtime,
    ResourceType.CLUSTER: cluster_pb2.Cluster,
    ResourceType.ENDPOINT: endpoint_pb2.ClusterLoadAssignment,
    ResourceType.LISTENER: listener_pb2.Listener,
    ResourceType.ROUTE: route_pb2.RouteConfiguration,
}
_URLS = {t: "type.googleapis.com/" + cls.DESCRIPTOR.full_name for t, cls in _CLASSES.items()}
_BY_URL = {url: t for t, url in _URLS.items()}
_SHORT = {
    ResourceType.RUNTIME: "rtds",
    ResourceType.CLUSTER: "cds",
    ResourceType.ENDPOINT: "eds",
    ResourceType.LISTENER: "lds",
    ResourceType.ROUTE: "rds",
}
_DEPENDENT = {
    ResourceType.CLUSTER: ResourceType.ENDPOINT,
    ResourceType.LISTENER: ResourceType.ROUTE,
}


def name_of(resource_type: ResourceType, message: Message) -> str:
    """The name a resource is requested by (a ClusterLoadAssignment's is its cluster_name)."""
    if resource_type is ResourceType.ENDPOINT:
        return str(message.cluster_name)
    return str(message.name)


def references_of(resource_type: ResourceType, message: Message) -> frozenset[str]:
    """Names of the `resource_type.dependent` resources this resource needs to become active.

    An EDS cluster needs the ClusterLoadAssignment named by its `service_name` (or its own
    name); a listener needs the RouteConfiguration each of its HTTP connection managers
    names through RDS. Other resources reference nothing.
    """
    if resource_type is ResourceType.CLUSTER:
        cluster: cluster_pb2.Cluster = message
        if cluster.WhichOneof("cluster_discovery_type") != "type" or cluster.type != cluster.EDS:
            return frozenset()
        return frozenset({cluster.eds_cluster_config.service_name or cluster.name})
    if resource_type is ResourceType.LISTENER:
        listener: listener_pb2.Listener = message
        packed = [f.typed_config for chain in listener.filter_chains for f in chain.filters]
        if listener.HasField("default_filter_chain"):
            packed += [f.typed_config for f in listener.default_filter_chain.filters]
        if listener.HasField("api_listener"):
            packed.append(listener.api_listener.api_listener)
        names: set[str] = set()
        for any_config in packed:
            if any_config.Is(_HCM.DESCRIPTOR):
                hcm = _HCM()
                any_config.Unpack(hcm)
                if hcm.HasField("rds"):
                    names.add(hcm.rds.route_config_name)
        return frozenset(names)
    return frozenset()
