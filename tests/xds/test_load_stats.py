"""LRS over a real gRPC channel, driven by a scripted client; the LoadReports store."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc
from google.protobuf import duration_pb2

from xds_server.telemetry import Telemetry
from xds_server.xds.load_reports import SPARE_REPORT_CLUSTERS, LoadReports, Rates
from xds_server.xds.load_stats import LoadStatsServer


async def eventually(predicate: Callable[[], bool], *, what: str) -> None:
    async with asyncio.timeout(2):
        while not predicate():  # noqa: ASYNC110 (polls another task's effect)
            await asyncio.sleep(0.01)
    assert predicate(), what


class Harness:
    def __init__(self, telemetry: Telemetry, reports: LoadReports, target: str) -> None:
        self.telemetry, self.reports, self.target = telemetry, reports, target

    def metric(self, name: str, **labels: str) -> float:
        return self.telemetry.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def lrs() -> AsyncIterator[Harness]:
    telemetry = Telemetry()
    reports = LoadReports(telemetry)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (LoadStatsServer(reports=reports, interval_s=0.25).generic_handler(),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Harness(telemetry, reports, f"127.0.0.1:{port}")
    finally:
        await server.stop(grace=None)


class Reporter:
    """A scripted Envoy load reporter."""

    def __init__(self, target: str, node_id: str, cluster: str) -> None:
        self.node = base_pb2.Node(id=node_id, cluster=cluster)
        self._channel = grpc.aio.insecure_channel(target)
        self._call: Any = lrs_pb2_grpc.LoadReportingServiceStub(self._channel).StreamLoadStats()

    async def send(self, *clusters: load_report_pb2.ClusterStats) -> None:
        await self._call.write(lrs_pb2.LoadStatsRequest(node=self.node, cluster_stats=clusters))

    async def recv(self) -> lrs_pb2.LoadStatsResponse:
        response: lrs_pb2.LoadStatsResponse = await asyncio.wait_for(self._call.read(), 2)
        return response

    async def close(self) -> None:
        self._call.cancel()
        await self._channel.close()


def stats(
    cluster: str, *localities: tuple[int, int, int, int], interval_s: float = 0.5
) -> load_report_pb2.ClusterStats:
    """Per locality: (in progress, successful, issued, errors)."""
    return load_report_pb2.ClusterStats(
        cluster_name=cluster,
        load_report_interval=duration_pb2.Duration(
            seconds=int(interval_s), nanos=int(interval_s % 1 * 1e9)
        ),
        upstream_locality_stats=[
            load_report_pb2.UpstreamLocalityStats(
                locality=base_pb2.Locality(zone=f"z{i}"),
                total_requests_in_progress=active,
                total_successful_requests=ok,
                total_issued_requests=issued,
                total_error_requests=errors,
            )
            for i, (active, ok, issued, errors) in enumerate(localities)
        ],
    )


async def test_first_request_is_answered_with_all_clusters_and_the_interval(lrs) -> None:  # type: ignore[no-untyped-def]
    reporter = Reporter(lrs.target, "envoy-1", "gateway")
    try:
        await reporter.send()
        response = await reporter.recv()
        assert response.send_all_clusters and not response.clusters
        assert response.load_reporting_interval.ToMilliseconds() == 250
        # Requests in flight per endpoint too: the pods busy with long prompts.
        assert response.report_endpoint_granularity
        [node] = lrs.reports.nodes()
        assert (node.node_id, node.group) == ("envoy-1", "gateway")
        assert lrs.metric("xds_lrs_streams") == 1
    finally:
        await reporter.close()


async def test_reports_are_summed_over_localities_and_envoys_and_forgotten_on_close(lrs) -> None:  # type: ignore[no-untyped-def]
    one = Reporter(lrs.target, "envoy-1", "gateway")
    two = Reporter(lrs.target, "envoy-2", "other")
    try:
        for reporter in (one, two):
            await reporter.send()
            await reporter.recv()
        await one.send(stats("p/critical", (2, 4, 5, 1), (1, 2, 2, 0)), stats("p/sheddable"))
        await two.send(stats("p/critical", (3, 0, 1, 0), interval_s=0.25))
        await eventually(lambda: lrs.metric("xds_lrs_reports_total") == 2, what="two reports")
        reports = lrs.reports
        assert reports.in_progress("p/critical") == 6
        assert reports.in_progress("p/critical", group="gateway") == 3
        assert reports.in_progress("p/sheddable") == 0
        assert reports.in_progress("unknown") == 0
        # Rates: the reported totals (latched since the last report) over the interval.
        assert reports.rates("p/critical", group="gateway") == Rates(
            successful_per_s=12.0, issued_per_s=14.0, errors_per_s=2.0
        )
        assert reports.rates("p/critical").issued_per_s == 18.0
        assert lrs.metric("xds_lrs_requests_in_progress", cluster="p/critical") == 6
        [dumped] = [n for n in reports.to_json() if n["node_id"] == "envoy-1"]
        assert dumped["clusters"]["p/critical"]["in_progress"] == 3  # type: ignore[index]

        # A later report replaces the earlier one.
        await one.send(stats("p/critical", (0, 1, 0, 0)))
        await eventually(lambda: reports.in_progress("p/critical") == 3, what="the new report")

        await two.close()
        await eventually(lambda: len(reports.nodes()) == 1, what="envoy-2 forgotten")
        assert reports.in_progress("p/critical") == 0
        assert lrs.metric("xds_lrs_streams") == 1
    finally:
        await one.close()
        await two.close()


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        LoadStatsServer(reports=LoadReports(Telemetry()), interval_s=0)


def _by_endpoint(cluster: str, *endpoints: tuple[str, int, int]) -> load_report_pb2.ClusterStats:
    """One locality whose endpoints ("address", port, in progress) report."""
    return load_report_pb2.ClusterStats(
        cluster_name=cluster,
        upstream_locality_stats=[
            load_report_pb2.UpstreamLocalityStats(
                total_requests_in_progress=sum(active for _, _, active in endpoints),
                upstream_endpoint_stats=[
                    load_report_pb2.UpstreamEndpointStats(
                        address=address_pb2.Address(
                            socket_address=address_pb2.SocketAddress(
                                address=address, port_value=port
                            )
                        ),
                        total_requests_in_progress=active,
                    )
                    for address, port, active in endpoints
                ],
            )
        ],
    )


def test_requests_in_flight_per_endpoint_are_summed_and_their_changes_told() -> None:
    changes: list[set[str]] = []
    reports = LoadReports(Telemetry())
    reports.subscribe(lambda clusters: changes.append(set(clusters)))
    for stream in (1, 2):
        reports.open(stream, base_pb2.Node(id=f"envoy-{stream}", cluster="gateway"))
    reports.report(1, [_by_endpoint("p/long", ("10.0.0.1", 8000, 1), ("10.0.0.2", 8000, 0))])
    reports.report(2, [_by_endpoint("p/long", ("10.0.0.1", 8000, 2)), _by_endpoint("p")])
    assert reports.in_progress_by_endpoint("p/long") == {"10.0.0.1:8000": 3}
    assert reports.in_progress_by_endpoint("p/long", group="elsewhere") == {}
    assert reports.in_progress_by_endpoint("p/long", excluding={"envoy-2"}) == {"10.0.0.1:8000": 1}
    assert reports.in_progress_by_endpoint("p") == {}
    # An endpoint with none in flight is not a change; a new report with the same counts
    # is not one either.
    assert changes == [{"p/long"}, {"p/long"}]
    reports.report(1, [_by_endpoint("p/long", ("10.0.0.1", 8000, 1))])
    assert len(changes) == 2
    reports.report(1, [_by_endpoint("p/long", ("10.0.0.2", 8000, 1))])
    assert changes[-1] == {"p/long"}
    assert reports.in_progress_by_endpoint("p/long") == {"10.0.0.1:8000": 2, "10.0.0.2:8000": 1}
    # A closed stream takes its requests with it.
    reports.close(2)
    assert changes[-1] == {"p/long"}
    assert reports.in_progress_by_endpoint("p/long") == {"10.0.0.2:8000": 1}
    reports.report(1, [_by_endpoint("p/long")])
    assert changes[-1] == {"p/long"} and len(changes) == 5
    assert reports.in_progress_by_endpoint("p/long") == {}


def test_an_internal_listener_endpoint_is_not_a_pod() -> None:
    """A spilling pod's entry in a session cluster is the pool's spill listener: its
    requests count in the cluster's total, but it is no pod's address."""
    reports = LoadReports(Telemetry())
    reports.open(1, base_pb2.Node(id="envoy-1", cluster="gateway"))
    stats = _by_endpoint("p/session", ("10.0.0.1", 8000, 1))
    spill = stats.upstream_locality_stats[0].upstream_endpoint_stats.add(
        total_requests_in_progress=2
    )
    spill.address.envoy_internal_address.server_listener_name = "p/spill"
    spill.address.envoy_internal_address.endpoint_id = "ns/pod-2"
    stats.upstream_locality_stats[0].total_requests_in_progress = 3
    reports.report(1, [stats])
    assert reports.in_progress_by_endpoint("p/session") == {"10.0.0.1:8000": 1}
    assert reports.in_progress("p/session") == 3


def test_clusters_the_server_never_pushed_are_dropped_and_a_report_naming_too_many_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry = Telemetry()
    reports = LoadReports(telemetry, known_clusters=lambda: frozenset({"p", "p/long"}))
    reports.open(1, base_pb2.Node(id="envoy-1", cluster="gateway"))
    reports.report(1, [_by_endpoint("p/long", ("10.0.0.1", 8000, 2)), _by_endpoint("made-up")])
    assert reports.in_progress_by_endpoint("p/long") == {"10.0.0.1:8000": 2}
    assert reports.clusters() == {"p/long"}

    def sample(name: str) -> float | None:
        return telemetry.registry.get_sample_value(name)

    assert sample("xds_lrs_unknown_clusters_total") == 1
    # As many made-up names as the server pushed plus the spare: dropped one by one.
    honest_at_most = 2 + SPARE_REPORT_CLUSTERS
    made_up = [_by_endpoint(f"made-up-{i}") for i in range(honest_at_most)]
    reports.report(1, made_up)
    assert sample("xds_lrs_unknown_clusters_total") == 1 + honest_at_most
    # One more: refused whole, even its known cluster; the last good figures stand.
    with caplog.at_level(logging.DEBUG, logger="xds_server.xds.load_reports"):
        for _ in range(3):
            reports.report(1, [*made_up, _by_endpoint("p/long", ("10.0.0.1", 8000, 9))])
    assert reports.in_progress_by_endpoint("p/long") == {"10.0.0.1:8000": 2}
    assert sample("xds_lrs_refused_reports_total") == 3
    assert sample("xds_lrs_unknown_clusters_total") == 1 + honest_at_most
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "names 1003 clusters" in caplog.records[0].getMessage()
    [node] = reports.to_json()
    assert (node["reports"], node["refused_reports"]) == (2, 3)
