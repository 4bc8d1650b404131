"""Mutual TLS on the gRPC port, with a real Envoy: the gateway works end to end over it; a
client without a certificate, with one of another CA, or with a node id its certificate
is not for cannot fetch resources, report load (LRS) or log long prompts (ALS), so it
cannot move any limit or weight; a certificate rotated on disk is
used by the next connection, and Envoy's stream stays up meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc

from tests.e2e.conftest import ConfigFile, chat, eventually
from xds_server.app import XdsApplication
from xds_server.envoy import names
from xds_server.envoy.bootstrap import BootstrapTls, render_bootstrap, render_sds_files
from xds_server.settings import ServerSettings, TlsSettings
from xds_server.xds.resources import ResourceType
from xds_testbed.backends import ExampleBackend
from xds_testbed.certs import CertificateAuthority, IssuedCertificate
from xds_testbed.envoy_process import EnvoyProcess

SERVER_NAME = "xds-server.test"
ENVOY_IDENTITY = "spiffe://test/envoy/{node_id}"


@dataclass
class Pki:
    ca: CertificateAuthority
    server: IssuedCertificate
    envoy: IssuedCertificate
    stranger: IssuedCertificate  # a valid-looking certificate of another CA
    root: Path


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = CertificateAuthority()
    return Pki(
        ca=ca,
        server=ca.issue(tmp_path / "server", dns=[SERVER_NAME]),
        envoy=ca.issue(tmp_path / "envoy", uris=["spiffe://test/envoy/envoy-1"]),
        stranger=CertificateAuthority("another CA").issue(
            tmp_path / "stranger", uris=["spiffe://test/envoy/envoy-1"]
        ),
        root=tmp_path,
    )


@contextlib.asynccontextmanager
async def _tls_gateway(pki: Pki, config: Path) -> AsyncIterator[tuple[XdsApplication, str]]:
    """The server over mutual TLS, and a real Envoy (node envoy-1) that reads its client
    certificate through SDS files; yields the app and Envoy's listener URL."""
    settings = ServerSettings(
        config_path=config,
        xds_port=0,
        admin_port=0,
        config_poll_s=0.05,
        tls=TlsSettings(
            cert=pki.server.cert,
            key=pki.server.key,
            client_ca=pki.server.ca,
            envoy_identity=ENVOY_IDENTITY,
        ),
    )
    tls = BootstrapTls(
        cert_dir=str(pki.envoy.directory), sds_dir=str(pki.root / "sds"), server_name=SERVER_NAME
    )
    (pki.root / "sds").mkdir()
    for name, content in render_sds_files(tls).items():
        (pki.root / "sds" / name).write_text(yaml.safe_dump(content))
    async with XdsApplication(settings) as app:
        await app.wait_ready(within_s=20)
        bootstrap = render_bootstrap(
            xds_address="127.0.0.1",
            xds_port=app.xds_port,
            node_id="envoy-1",
            node_cluster="gateway",
            admin_port=0,
            tls=tls,
        )
        async with EnvoyProcess(bootstrap, log_level="warn") as envoy:
            await envoy.wait_live(timeout=30)
            port = await envoy.listener_port(names.LISTENER_NAME)
            yield app, f"http://127.0.0.1:{port}"


def _channel(app: XdsApplication, pki: Pki, client: IssuedCertificate | None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.server.ca.read_bytes(),
        private_key=client.key.read_bytes() if client is not None else None,
        certificate_chain=client.cert.read_bytes() if client is not None else None,
    )
    return grpc.aio.secure_channel(
        f"127.0.0.1:{app.xds_port}",
        credentials,
        options=[("grpc.ssl_target_name_override", SERVER_NAME)],
    )


async def _fetch_clusters(channel: grpc.aio.Channel, node_id: str) -> grpc.StatusCode | None:
    """Ask for clusters over ADS as `node_id`; the status the stream failed with, or None
    if clusters came back."""
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    call = stub.StreamAggregatedResources()
    try:
        await call.write(
            discovery_pb2.DiscoveryRequest(
                node=base_pb2.Node(id=node_id), type_url=ResourceType.CLUSTER.url
            )
        )
        response = await asyncio.wait_for(call.read(), 20)
        assert response is not grpc.aio.EOF and response.resources
        return None
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        call.cancel()


async def _report_load(channel: grpc.aio.Channel, node_id: str) -> grpc.StatusCode | None:
    """Report 1,000 Critical requests in flight over LRS as `node_id`; the status the
    stream failed with, or None if the server took it."""
    stub = lrs_pb2_grpc.LoadReportingServiceStub(channel)
    call = stub.StreamLoadStats()
    try:
        await call.write(lrs_pb2.LoadStatsRequest(node=base_pb2.Node(id=node_id)))
        await asyncio.wait_for(call.read(), 20)
        fake = load_report_pb2.ClusterStats(
            cluster_name=names.band_cluster_name("pool", "critical"),
            upstream_locality_stats=[
                load_report_pb2.UpstreamLocalityStats(total_requests_in_progress=1000)
            ],
        )
        await call.write(lrs_pb2.LoadStatsRequest(cluster_stats=[fake]))
        await asyncio.wait_for(call.read(), 2)
        return None
    except TimeoutError:
        return None  # the server took the report (it answers only the first request)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        call.cancel()


async def _log_long_prompt(channel: grpc.aio.Channel, node_id: str) -> grpc.StatusCode | None:
    """Log a long prompt starting over ALS as `node_id`; the status the stream failed
    with, or None if the server took it."""
    stub = als_pb2_grpc.AccessLogServiceStub(channel)
    call = stub.StreamAccessLogs()
    entry = accesslog_pb2.HTTPAccessLogEntry(
        common_properties=accesslog_pb2.AccessLogCommon(
            upstream_cluster="pool/standard", access_log_type=accesslog_pb2.UpstreamPoolReady
        )
    )
    identifier = als_pb2.StreamAccessLogsMessage.Identifier(node=base_pb2.Node(id=node_id))
    try:
        await call.write(
            als_pb2.StreamAccessLogsMessage(
                identifier=identifier,
                http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=[entry]),
            )
        )
        await call.done_writing()
        await asyncio.wait_for(call, 20)
        return None
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def _served_serial(port: int, client: IssuedCertificate) -> int:
    """The serial number of the certificate a new TLS connection to `port` is served."""
    context = ssl.create_default_context(cafile=str(client.ca))
    context.load_cert_chain(client.cert, client.key)
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=SERVER_NAME) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


async def test_the_gateway_over_mutual_tls_refuses_strangers_and_takes_a_rotated_certificate(
    pki: Pki, config_file: ConfigFile
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        backend = await stack.enter_async_context(ExampleBackend(backend_id="pod", models=("m",)))
        config_file.write(
            {"pool": (["m"], [(backend, 1)])},
            flow_control={"enabled": True, "default_pod_concurrency": 8, "critical_headroom": 0},
        )
        app, url = await stack.enter_async_context(_tls_gateway(pki, config_file.path))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        status, served_by, _ = await chat(http, url, "m")
        assert (status, served_by) == (200, "pod")

        def standard_budget() -> int | None:
            admission = app.controller.decision.admissions.get("pool")
            return None if admission is None else admission.budget["standard"]

        await eventually(lambda: standard_budget() == 8, what="the Standard budget of 8")
        [envoy_stream] = [r for r in app.registry.streams() if r.node_id == "envoy-1"]
        refusals = "xds_auth_refusals_total"

        # No client certificate, or one of another CA: the handshake fails.
        for client in (None, pki.stranger):
            async with _channel(app, pki, client) as channel:
                assert await _fetch_clusters(channel, "envoy-1") == grpc.StatusCode.UNAVAILABLE
                assert await _report_load(channel, "envoy-1") == grpc.StatusCode.UNAVAILABLE
                assert await _log_long_prompt(channel, "envoy-1") == grpc.StatusCode.UNAVAILABLE
        # Envoy 1's certificate, speaking for another node: refused, and counted.
        async with _channel(app, pki, pki.envoy) as channel:
            denied = grpc.StatusCode.PERMISSION_DENIED
            assert await _fetch_clusters(channel, "envoy-evil") == denied
            assert await _report_load(channel, "envoy-evil") == denied
            assert await _log_long_prompt(channel, "envoy-evil") == denied
            # As itself, it may fetch (it is Envoy 1's certificate after all).
            assert await _fetch_clusters(channel, "envoy-1") is None
        registry = app.telemetry.registry
        for service in ("ads", "lrs", "als"):
            labels = {"service": service, "reason": "identity_mismatch"}
            assert (registry.get_sample_value(refusals, labels) or 0) >= 1, service
        # No limit moved: no fake report was taken.
        await asyncio.sleep(0.5)  # several decisions (every 0.25 s) had the chance
        assert standard_budget() == 8
        assert {r.node_id for r in app.load_reports.nodes()} <= {"envoy-1"}

        # Rotation: a new server certificate on disk serves the next connection; Envoy's
        # stream, opened with the old one, stays up.
        before = await asyncio.to_thread(_served_serial, app.xds_port, pki.envoy)
        rotated = pki.ca.issue(pki.server.directory, dns=[SERVER_NAME])
        assert rotated.serial() != before
        assert await asyncio.to_thread(_served_serial, app.xds_port, pki.envoy) == rotated.serial()
        assert [r.stream_id for r in app.registry.streams() if r.node_id == "envoy-1"] == [
            envoy_stream.stream_id
        ]
        status, served_by, _ = await chat(http, url, "m")
        assert (status, served_by) == (200, "pod")
