"""The xDS side: snapshot cache, protocol state machines (SotW, Delta), the gRPC ADS server,
the load reporting service (LRS) with its store of the Envoys' reports, and the access log
service (ALS) that tells where long prompts start."""

from xds_server.xds.ads import AdsServer
from xds_server.xds.cache import DEFAULT_GROUP, SnapshotCache
from xds_server.xds.load_reports import LoadReports
from xds_server.xds.load_stats import LoadStatsServer
from xds_server.xds.nodes import NodeRegistry
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

__all__ = [
    "AdsServer",
    "DEFAULT_GROUP",
    "LoadReports",
    "LoadStatsServer",
    "NodeRegistry",
    "ResourceType",
    "Snapshot",
    "SnapshotCache",
]
