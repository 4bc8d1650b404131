"""The xDS side: snapshot cache, protocol state machines (SotW, Delta), the gRPC ADS server."""

from xds_server.xds.cache import DEFAULT_GROUP, SnapshotCache
from xds_server.xds.nodes import NodeRegistry
from xds_server.xds.resources import ResourceType
from xds_server.xds.server import AdsServer
from xds_server.xds.snapshot import Snapshot

__all__ = [
    "AdsServer",
    "DEFAULT_GROUP",
    "NodeRegistry",
    "ResourceType",
    "Snapshot",
    "SnapshotCache",
]
