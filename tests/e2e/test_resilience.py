"""What happens when things go wrong: a dead xDS server, a config Envoy rejects."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.conftest import chat, eventually
from xds_server.envoy import names, render_bootstrap
from xds_testbed.envoy_process import EnvoyProcess


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.asynccontextmanager
async def server_process(config: Path, xds_port: int) -> AsyncIterator[asyncio.subprocess.Process]:
    """`xds-server run` as a separate process, so that it can be killed for real."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "xds_server", "--log-level", "warning",
        "run", "--config", str(config), "--xds-port", str(xds_port), "--admin-port", "0",
        "--config-poll", "0.1", "--plaintext",
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@pytest.mark.parametrize("protocol", ["sotw", "delta"])
async def test_envoy_survives_a_dead_server_and_follows_a_restarted_one(  # type: ignore[no-untyped-def]
    backends, config_file, http, protocol
) -> None:
    a, b = await backends("a"), await backends("b")
    config_file.write({"pool": (["m"], [(a, 1)])})
    xds_port = _free_port()
    bootstrap = render_bootstrap(
        xds_address="127.0.0.1", xds_port=xds_port, node_id="e2e", node_cluster="e2e", admin_port=0,
        delta=protocol == "delta",
    )  # fmt: skip
    async with (
        server_process(config_file.path, xds_port) as server,
        EnvoyProcess(bootstrap) as envoy,
    ):
        await envoy.wait_live(timeout=20)
        url = f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}"
        assert (await chat(http, url, "m"))[:2] == (200, "a")

        server.send_signal(signal.SIGKILL)
        await server.wait()
        await eventually(
            lambda: _stat(envoy, "control_plane.connected_state", 0),
            what="Envoy to see the server gone",
        )
        # Envoy keeps serving its last config while the server is away.
        for _ in range(20):
            assert (await chat(http, url, "m"))[:2] == (200, "a")

        # Meanwhile the config changes: a new pool (a new cluster), a new model, a new endpoint.
        config_file.write({"pool": (["m"], [(a, 1)]), "other": (["n"], [(b, 1)])})
        async with server_process(config_file.path, xds_port):
            await eventually(
                lambda: _stat(envoy, "control_plane.connected_state", 1),
                within_s=30,
                what="reconnection",
            )
            await eventually(
                lambda: _routes(http, url, "n", "b"), within_s=15, what="the new config"
            )
            assert (await chat(http, url, "m"))[:2] == (200, "a")
            # Nothing is left warming, and Envoy rejected nothing.
            stats = await envoy.get_stats("cluster_manager|listener_manager")
            assert stats["cluster_manager.warming_clusters"] == 0
            assert stats["listener_manager.total_listeners_warming"] == 0
            assert stats["cluster_manager.cds.update_rejected"] == 0


async def _stat(envoy: EnvoyProcess, name: str, expected: int) -> bool:
    return (await envoy.get_stats(name)).get(name) == expected


async def _routes(http, url: str, model: str, backend: str) -> bool:  # type: ignore[no-untyped-def]
    status, served_by, _ = await chat(http, url, model)
    return (status, served_by) == (200, backend)


async def test_rejected_config_is_nacked_counted_and_previous_keeps_serving(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    a, b = await backends("a"), await backends("b")
    config_file.write({"pool": (["m"], [(a, 1)])})
    gateway = await gateway_factory()
    app, envoy = gateway.app, gateway.envoy
    assert (await chat(http, gateway.url, "m"))[:2] == (200, "a")

    # The operator moves the listener to a port that another process holds: the config is
    # valid, but Envoy cannot bind it and rejects the listener update.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        config_file.write({"pool": (["m"], [(a, 1), (b, 1)])}, listener_port=taken)

        def nacked() -> bool:
            return any(
                r.last_nack is not None and r.last_nack.type == "lds"
                for r in app.registry.streams()
            )

        await eventually(nacked, what="Envoy to NACK the listener")
        [record] = app.registry.streams()
        assert record.last_nack is not None and str(taken) in record.last_nack.error
        assert app.telemetry.registry.get_sample_value("xds_nacks_total", {"type": "lds"}) == 1
        assert (await envoy.get_stats("listener_manager.lds.update_rejected"))[
            "listener_manager.lds.update_rejected"
        ] == 1
        # The old listener keeps serving; the accepted parts of the change (the new
        # endpoint, sent by EDS) are in force.
        assert (await chat(http, gateway.url, "m"))[0] == 200
        assert record.acked["lds"] != record.sent["lds"]

    # The next good config is sent and accepted.
    config_file.write({"pool": (["m"], [(a, 1), (b, 1)])}, listener_port=0)
    await eventually(lambda: record.acked.get("lds") == record.sent.get("lds"), what="the LDS ACK")
