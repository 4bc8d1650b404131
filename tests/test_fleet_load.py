"""The fleet's load: this replica's Envoys (LRS, ALS, ADS) merged with its peers' reports,
each Envoy counted once from the best source, and translated to pools, bands and Envoys."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import load_report_pb2
from google.protobuf import duration_pb2

from xds_server.config import parse_config
from xds_server.fleet_load import EnvoyLoad
from xds_server.peering.reports import ClusterReport, EnvoyReport, ReplicaReport
from xds_server.policy.shares import EnvoyDemand
from xds_server.telemetry import Telemetry
from xds_server.xds.access_logs import PrefillingPrompts
from xds_server.xds.load_reports import LoadReports
from xds_server.xds.nodes import NodeRegistry

CONFIG = parse_config(
    """
    flow_control: {enabled: true}
    pools:
      - {name: pool, models: [m], gpu_aware: false, endpoints: [{address: 10.0.0.1, port: 80}]}
    """
)


class Peers:
    """A PeerView holding fixed reports (what peering/links.py would have received)."""

    def __init__(self, *reports: ReplicaReport, reserved: float = 0.0) -> None:
        self._reports = [(r, 100.0 - i) for i, r in enumerate(reports)]
        self._reserved = reserved

    def reports(self) -> list[tuple[ReplicaReport, float]]:
        return self._reports

    def reserved(self) -> float:
        return self._reserved


def _stats(
    cluster: str, in_progress: int, issued: int, dropped: int
) -> load_report_pb2.ClusterStats:
    return load_report_pb2.ClusterStats(
        cluster_name=cluster,
        total_dropped_requests=dropped,
        load_report_interval=duration_pb2.Duration(seconds=1),
        upstream_locality_stats=[
            load_report_pb2.UpstreamLocalityStats(
                total_requests_in_progress=in_progress, total_issued_requests=issued
            )
        ],
    )


def _peer_envoy(node_id: str, in_progress: int, *, reports_load: bool = True) -> EnvoyReport:
    clusters = {"pool/standard": ClusterReport(in_progress=in_progress, issued_per_s=1.0)}
    return EnvoyReport(node_id=node_id, reports_load=reports_load, clusters=clusters)


def test_each_envoy_counts_once_from_its_best_source() -> None:
    telemetry = Telemetry()
    reports = LoadReports(telemetry)
    reports.open(1, base_pb2.Node(id="local-lrs"))
    reports.report(1, [_stats("pool/standard", 2, issued=3, dropped=4), _stats("other", 9, 9, 9)])
    registry = NodeRegistry(telemetry)
    record, observer = registry.open(protocol="sotw", peer="ipv4:127.0.0.1:1")
    observer.on_node(base_pb2.Node(id="moved"))  # ADS only here so far: a reconnect
    peers = Peers(
        ReplicaReport(
            replica="b",
            envoys=(
                _peer_envoy("moved", 5),  # its load, as its old replica last reported it
                _peer_envoy("local-lrs", 7),  # stale: our own load reports win
                _peer_envoy("remote", 1),
            ),
        ),
        reserved=0.25,
    )
    load = EnvoyLoad(
        reports, PrefillingPrompts(stale_s=1.0), replica="a", registry=registry, peers=peers
    )
    envoys = load.envoys(CONFIG)
    assert {node: source for node, (source, _) in envoys.items()} == {
        "local-lrs": "local",
        "moved": "b",
        "remote": "b",
    }
    fleet = load.fleet_load(CONFIG)
    bands = fleet.pools["pool"].bands
    assert bands.in_flight["standard"] == 2 + 5 + 1
    # Demand: in flight, and what was sent or refused per second.
    assert bands.by_envoy["local-lrs"]["standard"] == EnvoyDemand(in_flight=2, arrivals_per_s=7.0)
    assert fleet.reserved == 0.25
    # Only the config's lanes are passed on to peers.
    [own] = [e for e in load.local_report(CONFIG).envoys if e.node_id == "local-lrs"]
    assert set(own.clusters) == {"pool/standard"}
    [ads_only] = [e for e in load.local_report(CONFIG).envoys if e.node_id == "moved"]
    assert not ads_only.reports_load and ads_only.clusters == {}
    registry.close(record)


def test_a_peer_with_the_load_beats_a_peer_without() -> None:
    telemetry = Telemetry()
    peers = Peers(
        ReplicaReport(replica="new", envoys=(_peer_envoy("e", 0, reports_load=False),)),
        ReplicaReport(replica="old", envoys=(_peer_envoy("e", 4),)),
    )
    load = EnvoyLoad(LoadReports(telemetry), PrefillingPrompts(stale_s=1.0), peers=peers)
    [(source, envoy)] = load.envoys(CONFIG).values()
    assert source == "old" and envoy.clusters["pool/standard"].in_progress == 4


def test_a_weighted_tenants_lane_counts_in_its_band_and_apart_from_the_shared_lane() -> None:
    config = parse_config(
        """
        flow_control:
          enabled: true
          tenants: {header: x-tenant, named: {acme: {weight: 2}, other: {requests_per_s: 1}}}
        pools:
          - {name: pool, models: [m], gpu_aware: false, endpoints: [{address: 10.0.0.1, port: 80}]}
        """
    )
    telemetry = Telemetry()
    reports = LoadReports(telemetry)
    reports.open(1, base_pb2.Node(id="e1"))
    reports.report(
        1,
        [_stats("pool/standard", 2, issued=3, dropped=0), _stats("pool/standard/t/acme", 5, 4, 6)],
    )
    load = EnvoyLoad(reports, PrefillingPrompts(stale_s=1.0)).fleet_load(config)
    bands = load.pools["pool"].bands
    assert bands.in_flight["standard"] == 7
    assert bands.by_envoy["e1"]["standard"].in_flight == 2
    acme = bands.tenants_by_envoy["e1"]["standard"]["acme"]
    assert (acme.in_flight, acme.arrivals_per_s) == (5, 10.0)
    # Its lane goes to the peers too.
    (envoy,) = EnvoyLoad(reports, PrefillingPrompts(stale_s=1.0)).local_report(config).envoys
    assert "pool/standard/t/acme" in envoy.clusters
