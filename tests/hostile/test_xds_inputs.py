"""Hostile inputs on the gRPC port, from a client the server let in (plaintext here; over
mutual TLS, only a holder of an Envoy certificate gets this far, tests/e2e/test_mtls.py):
load reports naming 200,000 made-up clusters, and a flood of access log entries. Each is
bounded: the server keeps answering, its memory grows by less than MEMORY_BOUND, its
metrics page stays small, and the real Envoy's traffic and limits are untouched."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc
from google.protobuf import timestamp_pb2
from prometheus_client.parser import text_string_to_metric_families

from tests.hostile.conftest import Target

# What an attack may add to the server's resident memory (its baseline is ~80 MB).
MEMORY_BOUND = 40 * 1024 * 1024
METRICS_PAGE_BOUND = 256 * 1024


async def _metrics(target: Target) -> tuple[int, dict[str, float]]:
    """The size of /metrics, and its samples by name (labels ignored, values summed)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{target.server.admin_url}/metrics") as response:
            text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return len(text.encode()), samples


async def _standard_budget(target: Target) -> int:
    fleet = (await target.server.get_json("/debug/nodes"))["fleet"]
    return int(fleet["budgets"]["pool"]["budget"]["standard"])


async def test_load_reports_naming_200000_made_up_clusters_are_dropped(target: Target) -> None:
    budget = await _standard_budget(target)
    rss_before = target.server.rss_bytes()

    def report(batch: int, clusters: int) -> lrs_pb2.LoadStatsRequest:
        return lrs_pb2.LoadStatsRequest(
            cluster_stats=[
                load_report_pb2.ClusterStats(
                    cluster_name=f"made-up-{batch}-{i}",
                    upstream_locality_stats=[
                        load_report_pb2.UpstreamLocalityStats(total_requests_in_progress=1000)
                    ],
                )
                for i in range(clusters)
            ]
        )

    # Built before the attack: the attacker's own CPU is not the server's. Reports of
    # 10,000 names are refused whole; reports of 1,000 (within the room an honest Envoy has
    # for its own clusters) have every name looked up and dropped.
    reports = [report(batch, 10_000) for batch in range(10)]
    reports += [report(batch, 1_000) for batch in range(10, 110)]
    async with (
        target.probed(),
        grpc.aio.insecure_channel(f"127.0.0.1:{target.server.xds_port}") as channel,
    ):
        call = lrs_pb2_grpc.LoadReportingServiceStub(channel).StreamLoadStats()
        await call.write(lrs_pb2.LoadStatsRequest(node=base_pb2.Node(id="attacker")))
        await call.read()
        for sent, message in enumerate(reports):
            await call.write(message)
            if sent % 10 == 0:
                await target.real_requests(5)
        await _wait_for_counter(target, "xds_lrs_unknown_clusters_total", 100_000)
        await _wait_for_counter(target, "xds_lrs_refused_reports_total", 10)
        assert target.server.rss_bytes() - rss_before < MEMORY_BOUND
        size, _ = await _metrics(target)
        assert size < METRICS_PAGE_BOUND
        assert await _standard_budget(target) == budget
        await target.real_requests()
        call.cancel()
    nodes = (await target.server.get_json("/debug/nodes"))["load_reports"]
    assert all(not node["clusters"] for node in nodes if node["node_id"] == "attacker")


async def test_an_access_log_flood_is_bounded(target: Target) -> None:
    rss_before = target.server.rss_bytes()
    identifier = als_pb2.StreamAccessLogsMessage.Identifier(
        node=base_pb2.Node(id="attacker"), log_name="long_prompts"
    )
    messages = [
        als_pb2.StreamAccessLogsMessage(
            identifier=identifier if batch == 0 else None,
            http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(
                log_entry=[
                    _entry(cluster, batch * 1000 + i)
                    for i in range(1000)
                    for cluster in (f"made-up-{batch}-{i}", "pool/standard")
                ]
            ),
        )
        for batch in range(100)
    ]
    async with (
        target.probed(),
        grpc.aio.insecure_channel(f"127.0.0.1:{target.server.xds_port}") as channel,
    ):
        call = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs()
        for batch, message in enumerate(messages):
            await call.write(message)
            if batch % 20 == 0:
                await target.real_requests(5)
        await _wait_for_counter(target, "xds_als_dropped_entries_total", 100_000 + 99_000)
        assert target.server.rss_bytes() - rss_before < MEMORY_BOUND
        size, _ = await _metrics(target)
        assert size < METRICS_PAGE_BOUND
        await target.real_requests()
        await call.done_writing()


def _entry(cluster: str, n: int) -> accesslog_pb2.HTTPAccessLogEntry:
    """An upstream log entry of a stream that starts prefilling on 10.9.9.9:8000."""
    return accesslog_pb2.HTTPAccessLogEntry(
        common_properties=accesslog_pb2.AccessLogCommon(
            upstream_cluster=cluster,
            access_log_type=accesslog_pb2.UpstreamPoolReady,
            start_time=timestamp_pb2.Timestamp(seconds=1, nanos=n),
            upstream_remote_address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address="10.9.9.9", port_value=8000)
            ),
        )
    )


async def _wait_for_counter(target: Target, name: str, at_least: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        _, samples = await _metrics(target)
        if samples.get(name, 0.0) >= at_least:
            return
        assert loop.time() < deadline, f"{name} = {samples.get(name)}, expected {at_least}"
        await asyncio.sleep(0.2)
