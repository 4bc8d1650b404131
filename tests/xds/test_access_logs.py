"""Long prompts' prefill from Envoy's upstream access log: start, answer, end, expiry."""

from __future__ import annotations

from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import timestamp_pb2

from xds_server.config import parse_config
from xds_server.fleet_load import EnvoyLoad
from xds_server.telemetry import Telemetry
from xds_server.xds.access_logs import AccessLogStream, PrefillingPrompts
from xds_server.xds.load_reports import LoadReports


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(
    kind: int, request: str, port: int = 8000, *, answered: int = 0
) -> accesslog_pb2.HTTPAccessLogEntry:
    """An upstream log entry; `answered`: response body bytes received (which an upstream
    log reports as `request.request_body_bytes`, see access_logs.py)."""
    # Envoy leaves stream_id empty here: a stream is its start time and connections.
    return accesslog_pb2.HTTPAccessLogEntry(
        common_properties=accesslog_pb2.AccessLogCommon(
            access_log_type=kind,  # type: ignore[arg-type]
            start_time=timestamp_pb2.Timestamp(seconds=1_800_000_000, nanos=ord(request[0])),
            upstream_local_address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address="10.9.0.1", port_value=40000)
            ),
            upstream_cluster="p/long",
            upstream_remote_address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address="10.0.0.1", port_value=port)
            ),
        ),
        request=accesslog_pb2.HTTPRequestProperties(request_body_bytes=answered),
    )


def message(*entries: accesslog_pb2.HTTPAccessLogEntry) -> als_pb2.StreamAccessLogsMessage:
    return als_pb2.StreamAccessLogsMessage(
        identifier=als_pb2.StreamAccessLogsMessage.Identifier(
            node=base_pb2.Node(id="envoy-1"), log_name="long_prompts"
        ),
        http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=entries),
    )


START, PERIODIC, END = (
    accesslog_pb2.UpstreamPoolReady,
    accesslog_pb2.UpstreamPeriodic,
    accesslog_pb2.UpstreamEnd,
)


def test_a_long_prompt_prefills_from_its_start_to_its_first_response_bytes() -> None:
    clock, changes = Clock(), []
    prompts = PrefillingPrompts(stale_s=1.0, clock=clock)
    prompts.subscribe(changes.append)
    telemetry = Telemetry()
    stream = AccessLogStream(stream_id=1, prompts=prompts, telemetry=telemetry)
    stream.receive(message(entry(START, "a"), entry(START, "b"), entry(START, "c", port=8001)))
    assert stream.node_id == "envoy-1" and prompts.nodes() == {"envoy-1"}
    assert prompts.prefilling("p/long") == {"10.0.0.1:8000": 2, "10.0.0.1:8001": 1}
    assert prompts.prefilling("p") == {}
    assert changes == [{"p/long"}] * 3
    # Still prefilling: no change. "a" answers (its first token), "c" ends; an end or an
    # answer of a stream not prefilling changes nothing.
    stream.receive(message(entry(PERIODIC, "a"), entry(PERIODIC, "a", answered=183)))
    stream.receive(message(entry(END, "c", port=8001), entry(END, "a"), entry(END, "z")))
    assert prompts.prefilling("p/long") == {"10.0.0.1:8000": 1}
    assert changes == [{"p/long"}] * 5
    sample = telemetry.registry.get_sample_value
    assert sample("xds_als_entries_total", {"type": "UpstreamPoolReady"}) == 3
    assert sample("xds_als_entries_total", {"type": "UpstreamPeriodic"}) == 2
    assert sample("xds_als_entries_total", {"type": "UpstreamEnd"}) == 3


def test_a_prompt_unheard_of_for_stale_s_is_dropped_and_a_closed_stream_takes_its_own() -> None:
    clock = Clock()
    prompts = PrefillingPrompts(stale_s=1.0, clock=clock)
    first = AccessLogStream(stream_id=1, prompts=prompts, telemetry=Telemetry())
    second = AccessLogStream(stream_id=2, prompts=prompts, telemetry=Telemetry())
    first.receive(message(entry(START, "a"), entry(START, "b")))
    clock.now += 0.6
    # The same stream id from another Envoy is another request; "b" is heard of again.
    second.receive(message(entry(START, "a")))
    first.receive(message(entry(PERIODIC, "b")))
    assert prompts.prefilling("p/long") == {"10.0.0.1:8000": 3}
    clock.now += 0.6
    # "a" of the first Envoy was last heard of 1.2 s ago: its end was lost.
    assert prompts.prefilling("p/long") == {"10.0.0.1:8000": 2}
    second.close()
    assert prompts.prefilling("p/long") == {"10.0.0.1:8000": 1}
    assert prompts.nodes() == {"envoy-1"}
    first.close()
    assert prompts.prefilling("p/long") == {} and prompts.nodes() == set()
    assert prompts._open == {}


def test_the_policy_sees_prompts_logged_prefilling_and_reported_by_envoys_that_do_not_log() -> None:
    reports = LoadReports(Telemetry())
    reports.open(1, base_pb2.Node(id="envoy-1"))
    reports.open(2, base_pb2.Node(id="envoy-2"))
    # Envoy 1 reports one in flight on :8000, but logs that it answers already: decoding.
    reports.report(1, [_reported("p/long", 8000, 1)])
    reports.report(2, [_reported("p/long", 8002, 1)])
    prompts = PrefillingPrompts(stale_s=1.0, clock=Clock())
    stream = AccessLogStream(stream_id=1, prompts=prompts, telemetry=Telemetry())
    stream.receive(message(entry(START, "a"), entry(START, "b", port=8001)))
    stream.receive(message(entry(PERIODIC, "a", answered=200)))
    config = parse_config(
        """
        pools:
          - {name: p, models: [m]}
          - {name: q, models: [n]}
        """
    )
    envoy_load = EnvoyLoad(reports, prompts)
    fleet = envoy_load.fleet_load(config)
    # Translated from cluster names once: `p/long` is pool p's long-prompt lane. Envoy 2
    # does not log: its reported request counts, prefilling or not.
    assert fleet.pools["p"].long_prompts == {"10.0.0.1:8001": 1, "10.0.0.1:8002": 1}
    assert fleet.pools["q"].long_prompts == {}
    assert set(envoy_load.envoys(config)) == {"envoy-1", "envoy-2"}


def _reported(cluster: str, port: int, active: int) -> load_report_pb2.ClusterStats:
    return load_report_pb2.ClusterStats(
        cluster_name=cluster,
        upstream_locality_stats=[
            load_report_pb2.UpstreamLocalityStats(
                total_requests_in_progress=active,
                upstream_endpoint_stats=[
                    load_report_pb2.UpstreamEndpointStats(
                        address=address_pb2.Address(
                            socket_address=address_pb2.SocketAddress(
                                address="10.0.0.1", port_value=port
                            )
                        ),
                        total_requests_in_progress=active,
                    )
                ],
            )
        ],
    )
