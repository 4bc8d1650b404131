"""A whole local gateway: this xDS server and a real Envoy that it configures.

The demo, the end-to-end tests and the benchmarks all run exactly this pairing, so it lives
here once: the server in-process (its cache, registry and metrics are at hand), Envoy as a
child process bootstrapped to the server's bound port.

The fault benchmark (scenario g) kills the server and starts a new one on the same port
(`LocalGateway.kill_server`, then `start_server`). The server being in-process, the kill is not a
SIGKILL of a process but what Envoy sees of one (`XdsApplication.kill`): the gRPC server
stops with no grace, so every xDS stream is cut at once and the port refuses, and nothing
of the old server (controller, scraper, caches) survives into the new one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from xds_server.app import XdsApplication
from xds_server.envoy import names, render_bootstrap
from xds_server.settings import KubernetesSettings, ServerSettings
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.server_process import free_port

__all__ = ["ACCESS_LOG_FLUSH_MS", "LocalGateway", "run_local_gateway"]

# How often Envoy writes its access log (Envoy's default, 10 s, is long for a demo and
# for tests that read the lines).
ACCESS_LOG_FLUSH_MS = 250


@dataclass
class LocalGateway:
    """Mutable state: `app`, replaced by `start_server` after `kill_server`."""

    app: XdsApplication
    envoy: EnvoyProcess
    # Where Envoy accepts OpenAI-style requests, e.g. http://127.0.0.1:8080.
    url: str
    # The running server's exit, closed when the gateway stops (or the server is killed).
    _exit: contextlib.AsyncExitStack

    async def kill_server(self) -> None:
        """Kill the server abruptly: its gRPC server stops with no grace (every xDS stream
        cut, the port refusing), then the rest of it stops. `start_server` replaces it."""
        await self.app.kill()
        await self._exit.aclose()

    async def start_server(self) -> XdsApplication:
        """Start a new server with the killed one's settings on the same xDS port (its
        config read afresh from the settings' source); returns it once it listens, without
        waiting for its first snapshot or for Envoy."""
        settings = replace(self.app.settings, xds_port=self.app.xds_port, admin_port=0)
        self._exit = contextlib.AsyncExitStack()
        self.app = await self._exit.enter_async_context(XdsApplication(settings))
        return self.app


@asynccontextmanager
async def run_local_gateway(
    config_path: Path | None,
    *,
    kubernetes: KubernetesSettings | None = None,
    delta: bool = False,
    node_id: str = "envoy-local",
    config_poll_s: float = 0.2,
    envoy_log_level: str = "warn",
    start_timeout_s: float = 20.0,
    load_report_interval_s: float | None = None,
    stats_port: int | None = None,
) -> AsyncIterator[LocalGateway]:
    """Start the server on `config_path` (or on Kubernetes, `kubernetes`) and an Envoy that
    takes its config from it.

    Returns once Envoy is LIVE with the listener bound (all on 127.0.0.1; the server's ports
    and a listener port of 0 are chosen by the OS and read back). `load_report_interval_s`
    overrides the server's LRS interval. `stats_port` gives Envoy its stats listener there
    (bootstrap.STATS_LISTENER). Envoy writes its access log every ACCESS_LOG_FLUSH_MS.
    """
    settings = ServerSettings(
        config_path=config_path,
        kubernetes=kubernetes,
        xds_port=0,
        admin_port=0,
        config_poll_s=config_poll_s,
    )
    if load_report_interval_s is not None:
        settings = replace(settings, load_report_interval_s=load_report_interval_s)
    admin_port = free_port() if stats_port is not None else 0
    async with contextlib.AsyncExitStack() as outer:
        server_exit = contextlib.AsyncExitStack()
        app = await server_exit.enter_async_context(XdsApplication(settings))
        gateway: LocalGateway | None = None

        async def stop_server() -> None:
            await (gateway._exit if gateway is not None else server_exit).aclose()

        outer.push_async_callback(stop_server)
        await app.wait_ready(within_s=start_timeout_s)
        bootstrap = render_bootstrap(
            xds_address="127.0.0.1",
            xds_port=app.xds_port,
            node_id=node_id,
            node_cluster="local",
            # The stats listener forwards to a fixed admin port.
            admin_port=admin_port,
            delta=delta,
            stats_port=stats_port,
            stats_address="127.0.0.1",
        )
        envoy = await outer.enter_async_context(
            EnvoyProcess(
                bootstrap,
                log_level=envoy_log_level,
                admin_port=admin_port,
                extra_args=("--file-flush-interval-msec", str(ACCESS_LOG_FLUSH_MS)),
            )
        )
        await envoy.wait_live(timeout=start_timeout_s)
        port = await envoy.listener_port(names.LISTENER_NAME)
        gateway = LocalGateway(
            app=app, envoy=envoy, url=f"http://127.0.0.1:{port}", _exit=server_exit
        )
        yield gateway
