"""A whole local gateway: this xDS server and a real Envoy that it configures.

The demo, the end-to-end tests and the benchmarks all run exactly this pairing, so it lives
here once: the server in-process (its cache, registry and metrics are at hand), Envoy as a
child process bootstrapped to the server's bound port.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from xds_server.app import XdsApplication
from xds_server.envoy import names, render_bootstrap
from xds_server.settings import KubernetesSettings, ServerSettings
from xds_testbed.envoy_process import EnvoyProcess

__all__ = ["LocalGateway", "run_local_gateway"]


@dataclass(frozen=True)
class LocalGateway:
    app: XdsApplication
    envoy: EnvoyProcess
    # Where Envoy accepts OpenAI-style requests, e.g. http://127.0.0.1:8080.
    url: str


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
) -> AsyncIterator[LocalGateway]:
    """Start the server on `config_path` (or on Kubernetes, `kubernetes`) and an Envoy that
    takes its config from it.

    Returns once Envoy is LIVE with the listener bound (all on 127.0.0.1; the server's ports
    and a listener port of 0 are chosen by the OS and read back). `load_report_interval_s`
    overrides the server's LRS interval.
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
    async with XdsApplication(settings) as app:
        await app.wait_ready(within_s=start_timeout_s)
        bootstrap = render_bootstrap(
            xds_address="127.0.0.1",
            xds_port=app.xds_port,
            node_id=node_id,
            node_cluster="local",
            admin_port=0,
            delta=delta,
        )
        async with EnvoyProcess(bootstrap, log_level=envoy_log_level) as envoy:
            await envoy.wait_live(timeout=start_timeout_s)
            port = await envoy.listener_port(names.LISTENER_NAME)
            yield LocalGateway(app=app, envoy=envoy, url=f"http://127.0.0.1:{port}")
