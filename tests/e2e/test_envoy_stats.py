"""Envoy's stats for Prometheus, on the stats listener of the bootstrap this server renders
(bootstrap.STATS_LISTENER), never on the admin interface."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import chat
from xds_server.envoy.bootstrap import STATS_PATH
from xds_testbed.gateway import run_local_gateway
from xds_testbed.server_process import free_port

OPERATIONS = Path(__file__).parents[2] / "docs" / "operations.md"

# The counters and gauges docs/operations.md tells operators to watch.
DOCUMENTED = (
    "envoy_cluster_upstream_rq_total",
    "envoy_cluster_upstream_rq_xx",
    "envoy_cluster_upstream_rq_pending_overflow",
    "envoy_cluster_upstream_rq_retry",
    "envoy_cluster_upstream_rq_retry_overflow",
    "envoy_cluster_outlier_detection_ejections_active",
    "envoy_cluster_membership_healthy",
    "envoy_cluster_circuit_breakers_default_rq_open",
    "envoy_http_downstream_rq_xx",
    "envoy_control_plane_connected_state",
    "envoy_cluster_manager_cds_update_rejected",
    "envoy_listener_manager_lds_update_rejected",
)


async def test_the_stats_listener_serves_prometheus_text_and_nothing_else(  # type: ignore[no-untyped-def]
    backends, config_file, http
) -> None:
    backend = await backends("llama-0")
    config_file.write({"llama": (["llama"], [(backend, 1)])})
    stats_port = free_port()
    async with run_local_gateway(config_file.path, config_poll_s=0.05, stats_port=stats_port) as gw:
        status, _, _ = await chat(http, gw.url, "llama")
        assert status == 200
        stats_url = f"http://127.0.0.1:{stats_port}"
        async with http.get(f"{stats_url}{STATS_PATH}") as response:
            assert response.status == 200
            assert response.headers["content-type"].startswith("text/plain")
            text = await response.text()
        names = {line.split("{")[0].split()[0] for line in text.splitlines() if line[:1].isalpha()}
        assert set(DOCUMENTED) <= names, sorted(set(DOCUMENTED) - names)
        # The request above, counted on its pool's cluster.
        assert any(
            line.startswith('envoy_cluster_upstream_rq_total{envoy_cluster_name="llama"}')
            and line.rsplit(" ", 1)[1] != "0"
            for line in text.splitlines()
        ), "the pool cluster's request counter"

        # Nothing of the admin interface but the stats: no other page, no other method.
        for method, path in (
            ("GET", "/stats"),
            ("GET", "/config_dump"),
            ("POST", "/quitquitquit"),
            ("POST", "/runtime_modify?x=1"),
            ("POST", STATS_PATH),
        ):
            async with http.request(method, f"{stats_url}{path}") as response:
                assert response.status == 404, (method, path)
        # Envoy is still there and still routes.
        assert (await chat(http, gw.url, "llama"))[0] == 200


def test_the_documented_counters_are_the_ones_checked() -> None:
    text = OPERATIONS.read_text()
    assert all(f"`{name}`" in text for name in DOCUMENTED)
