"""The admin and debug endpoints of a running server, over HTTP.

The admin listener serves probes and metrics and nothing under /debug; the debug views
are on their own listener, on loopback (xds_server/admin.py says why). Readiness names the
pools without a healthy endpoint, and stays 200 (admin.py says why).
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import eventually
from tests.xds.conftest import RawClient
from xds_server.admin import default_debug_port, readiness
from xds_server.app import XdsApplication
from xds_server.config import RoutingConfig, parse_config
from xds_server.metrics.scraper import ScraperState
from xds_server.policy.decision import Decision
from xds_server.policy.state import EndpointState, Health, PoolState
from xds_server.settings import ServerSettings
from xds_server.xds.resources import ResourceType

CONFIG = """
listener: {address: 127.0.0.1, port: 0}
updates: {debounce_s: 0.01}
pools: [{name: pool, models: [m], endpoints: [{address: 127.0.0.1, port: 9}]}]
"""

DEBUG_PATHS = ("/debug/nodes", "/debug/snapshot", "/debug/config")


def _non_loopback_address() -> str | None:
    """This machine's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route is looked up
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


async def test_probes_metrics_and_debug_views(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("pools: []")  # invalid: not ready, and it says why
    settings = ServerSettings(config_path=path, xds_port=0, admin_port=0, config_poll_s=0.05)
    async with (
        XdsApplication(settings) as app,
        aiohttp.ClientSession() as http,
    ):
        admin = f"http://127.0.0.1:{app.admin_port}"
        views = f"http://127.0.0.1:{app.debug_port}"

        async def get(base: str, path: str) -> tuple[int, object]:
            async with http.get(base + path) as response:
                return response.status, await response.json()

        assert await get(admin, "/healthz") == (200, {"status": "ok"})
        deadline = asyncio.get_running_loop().time() + 20
        while "pools" not in (body := (await get(admin, "/readyz"))[1])["reason"]:  # type: ignore[index]
            assert asyncio.get_running_loop().time() < deadline, body
            await asyncio.sleep(0.05)
        status, body = await get(admin, "/readyz")
        assert status == 503 and "pools" in body["reason"]  # type: ignore[index]
        status, body = await get(views, "/debug/config")
        assert body["config"] is None and "pools" in body["last_error"]  # type: ignore[index]

        path.write_text(CONFIG)
        await app.wait_ready(within_s=20)
        assert (await get(admin, "/readyz"))[0] == 200

        client = RawClient(f"127.0.0.1:{app.xds_port}", node_id="envoy-7")
        await client.send(ResourceType.CLUSTER.url)
        cds = await client.recv()
        await client.send(
            ResourceType.CLUSTER.url, version_info=cds.version_info, response_nonce=cds.nonce
        )
        await app.registry.wait_for_ack("cds", cds.version_info)

        status, body = await get(views, "/debug/nodes")
        [stream] = body["streams"]  # type: ignore[index]
        assert stream["node_id"] == "envoy-7" and stream["acked_versions"] == {
            "cds": cds.version_info
        }
        # One Envoy's view (a whole fleet's is megabytes): only that node, or none.
        status, body = await get(views, "/debug/nodes?node=envoy-7")
        assert [s["node_id"] for s in body["streams"]] == ["envoy-7"]  # type: ignore[index]
        status, body = await get(views, "/debug/nodes?node=no-such-envoy")
        assert status == 200 and body["streams"] == []  # type: ignore[index]
        assert body["fleet"]["envoys"] == []  # type: ignore[index]
        status, body = await get(views, "/debug/snapshot")
        groups = body["groups"]  # type: ignore[index]
        assert groups["(default)"]["cds"]["version"] == cds.version_info
        assert list(groups["(default)"]["cds"]["resources"]) == ["pool", "pool/long"]

        async with http.get(admin + "/metrics") as response:
            assert response.status == 200
            text = await response.text()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("xds_connected_streams", (("protocol", "sotw"),))] == 1
        assert samples[("xds_responses_total", (("type", "cds"),))] == 1
        assert samples[("xds_push_duration_seconds_count", (("type", "cds"),))] == 1
        assert samples[("xds_config_reloads_total", (("result", "error"),))] >= 1
        assert samples[("xds_config_reloads_total", (("result", "ok"),))] == 1
        version_series = [
            k for k in samples if k[0] == "xds_snapshot_version_info" and ("type", "cds") in k[1]
        ]
        assert version_series == [
            (
                "xds_snapshot_version_info",
                (("group", ""), ("type", "cds"), ("version", cds.version_info)),
            )
        ]
        await client.close()


async def test_the_admin_port_serves_no_debug_view(tmp_path: Path) -> None:
    """The admin port is the one a Service and Prometheus reach: /debug is not there, in
    any form, while the probes and metrics are."""
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    settings = ServerSettings(config_path=path, xds_port=0, admin_port=0)
    async with XdsApplication(settings) as app, aiohttp.ClientSession() as http:
        await app.wait_ready(within_s=20)
        admin = f"http://127.0.0.1:{app.admin_port}"
        for path_ in (*DEBUG_PATHS, "/debug", "/debug/", "/debug/nodes/"):
            async with http.get(admin + path_) as response:
                assert response.status == 404, path_
                assert "envoy" not in (await response.text()).lower()
        for path_ in ("/healthz", "/readyz", "/metrics"):
            async with http.get(admin + path_) as response:
                assert response.status == 200, path_


async def test_the_debug_listener_is_on_loopback_only(tmp_path: Path) -> None:
    """Bound to 127.0.0.1: it answers there, and on this machine's other address the port
    is closed; it serves the debug views and nothing else."""
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    settings = ServerSettings(config_path=path, xds_port=0, admin_port=0)
    async with (
        XdsApplication(settings) as app,
        aiohttp.ClientSession() as http,
    ):
        await app.wait_ready(within_s=20)
        assert app.settings.debug_host == "127.0.0.1" and app.debug_port != 0
        views = f"http://127.0.0.1:{app.debug_port}"
        for path_ in DEBUG_PATHS:
            async with http.get(views + path_) as response:
                assert response.status == 200, path_
        for path_ in ("/metrics", "/healthz", "/readyz"):
            async with http.get(views + path_) as response:
                assert response.status == 404, path_

        outside = _non_loopback_address()
        if outside is None:
            pytest.skip("no non-loopback address to try the debug port from")
        with pytest.raises(ConnectionRefusedError):
            _, writer = await asyncio.open_connection(outside, app.debug_port)
            writer.close()


def test_the_default_debug_port_is_next_to_the_admin_port() -> None:
    assert default_debug_port(9000) == 9001
    assert default_debug_port(0) == 0  # tests: a free port, never a fixed one


async def test_a_failed_start_closes_what_it_opened(tmp_path: Path) -> None:
    # The admin port is taken: the start fails, and the gRPC server and the scraper it had
    # already opened are closed again (the AsyncExitStack unwinds), so a retry can bind.
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    taken = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = taken.sockets[0].getsockname()[1]
    try:
        settings = ServerSettings(config_path=path, xds_port=0, admin_port=port)
        app = XdsApplication(settings)
        with pytest.raises(OSError, match="Cannot start the admin server"):
            await app.__aenter__()
        assert app.scraper.state is ScraperState.CLOSED
        xds_port = app.xds_port
        # The xDS port is free again.
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", xds_port)
        probe.close()
        await probe.wait_closed()
    finally:
        taken.close()
        await taken.wait_closed()


async def test_kill_closes_everything_and_frees_the_port_at_once(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    settings = ServerSettings(config_path=path, xds_port=0, admin_port=0, config_poll_s=0.05)
    app = XdsApplication(settings)
    await app.__aenter__()
    await app.wait_ready(within_s=20)
    await app.kill()
    assert app.scraper.state is ScraperState.CLOSED
    # A new server can take the same port at once, as a restarted process would.
    again = ServerSettings(config_path=path, xds_port=app.xds_port, admin_port=0)
    async with XdsApplication(again) as restarted:
        assert restarted.xds_port == app.xds_port


async def test_a_pool_left_without_endpoints_is_counted_on_the_servers_metrics(
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("pools: [{name: empty, models: [m]}]")
    settings = ServerSettings(config_path=path, xds_port=0, admin_port=0)
    async with XdsApplication(settings) as app:
        await app.wait_ready(within_s=20)
        warnings = app.telemetry.registry.get_sample_value(
            "xds_config_warnings_total", {"reason": "pool_without_endpoints"}
        )
        assert warnings == 1


@dataclass
class Readiness:
    """The controller as /readyz reads it (admin.ReadinessView)."""

    ready: bool
    config: RoutingConfig | None
    decision: Decision = field(default_factory=Decision)
    last_error: str | None = None


def test_readiness_names_the_pools_without_a_healthy_endpoint_and_stays_200() -> None:
    config = parse_config(
        "pools: [{name: a, models: [m], endpoints: [{address: 10.0.0.1, port: 80}]},"
        " {name: b, models: [n], endpoints: [{address: 10.0.0.2, port: 80}]},"
        " {name: c, models: [o], allow_empty: true}]"
    )
    assert readiness(Readiness(ready=False, config=None)) == (
        503,
        {"status": "not ready", "reason": "no snapshot yet"},
    )
    assert readiness(Readiness(ready=False, config=None, last_error="c.yaml: bad")) == (
        503,
        {"status": "not ready", "reason": "c.yaml: bad"},
    )
    unhealthy = PoolState(
        name="b",
        endpoints=(EndpointState(address="10.0.0.2", port=80, weight=1, health=Health.UNHEALTHY),),
    )
    view = Readiness(ready=True, config=config, decision=Decision(pools={"b": unhealthy}))
    assert readiness(view) == (
        200,
        {"status": "degraded", "pools_without_healthy_endpoints": ["b", "c"], "last_error": None},
    )
    view.config = config.model_copy(update={"pools": config.pools[:1]})
    view.last_error = "c.yaml: refused: ..."
    assert readiness(view) == (
        200,
        {
            "status": "ready",
            "pools_without_healthy_endpoints": [],
            "last_error": "c.yaml: refused: ...",
        },
    )


STATIC = """
listener: {address: 127.0.0.1, port: 0}
updates: {debounce_s: 0.01}
pools: [{name: pool, models: [m], gpu_aware: false, %s}]
"""


async def test_an_edit_that_empties_a_pool_is_refused_and_an_allowed_one_shows_on_readyz(
    tmp_path: Path,
) -> None:
    """Through the real config-file watcher and the admin listener: a pool's last endpoint
    taken away is refused (the last good config stays; /readyz says why and stays ready);
    with `allow_empty` it is applied, and /readyz (200, degraded) and
    xds_pool_healthy_endpoints say the pool has no healthy endpoint."""
    path = tmp_path / "config.yaml"
    path.write_text(STATIC % "endpoints: [{address: 127.0.0.1, port: 9}]")
    settings = ServerSettings(config_path=path, xds_port=0, admin_port=0, config_poll_s=0.05)
    async with XdsApplication(settings) as app, aiohttp.ClientSession() as http:
        await app.wait_ready(within_s=30)
        registry = app.telemetry.registry
        good = app.controller.config

        async def readyz() -> tuple[int, dict[str, object]]:
            async with http.get(f"http://127.0.0.1:{app.admin_port}/readyz") as response:
                return response.status, await response.json()

        def healthy() -> float | None:
            return registry.get_sample_value("xds_pool_healthy_endpoints", {"pool": "pool"})

        def refusals() -> float:
            return registry.get_sample_value("xds_config_reloads_total", {"result": "error"}) or 0

        assert await readyz() == (
            200,
            {"status": "ready", "pools_without_healthy_endpoints": [], "last_error": None},
        )
        assert healthy() == 1

        path.write_text(STATIC % "endpoints: []")
        await eventually(lambda: refusals() == 1, within_s=60, what="the refusal")
        status, body = await readyz()
        assert status == 200 and body["status"] == "ready"
        assert "refused" in str(body["last_error"]) and "'pool' (had 1)" in str(body["last_error"])
        assert app.controller.config == good
        assert registry.get_sample_value("xds_config_last_reload_successful") == 0
        assert healthy() == 1

        path.write_text(STATIC % "endpoints: [], allow_empty: true")

        async def degraded() -> bool:
            return (await readyz())[1]["status"] == "degraded"

        await eventually(degraded, within_s=60, what="/readyz to say degraded")
        assert await readyz() == (
            200,
            {"status": "degraded", "pools_without_healthy_endpoints": ["pool"], "last_error": None},
        )
        assert healthy() == 0
        assert refusals() == 1
