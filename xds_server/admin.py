"""The admin HTTP endpoint: Prometheus metrics, probes, and JSON views for humans.

/metrics         the server's Prometheus metrics (telemetry.py)
/healthz         200 while the process serves (liveness)
/readyz          200 once a snapshot is in the cache, else 503 (readiness)
/debug/nodes     connected Envoys: node, versions sent and ACKed per type, last NACK, and
                 their latest load reports (LRS) per cluster; the fleet: this replica's
                 peers, every Envoy the policy counts (and where it was heard of), its
                 limits per pool and band, and each band's fleet-wide budget
/debug/snapshot  the snapshot of every group: versions and resource names; and the
                 versions of each Envoy that has its own admission limits
/debug/config    the routing config in force, the last config error, and on Kubernetes the
                 watches, objectives and objects that could not be used
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from xds_server.controller import Controller
from xds_server.telemetry import Telemetry
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.nodes import NodeRegistry

__all__ = ["AdminServer", "DebugSource", "make_admin_app"]


def _json(payload: Any, *, status: int = 200) -> web.Response:
    return web.json_response(
        payload, status=status, dumps=lambda o: json.dumps(o, indent=2, sort_keys=True)
    )


class DebugSource(Protocol):
    """Something with more to show on /debug/config (Kubernetes discovery)."""

    def debug(self) -> dict[str, Any]: ...


def make_admin_app(
    *,
    telemetry: Telemetry,
    registry: NodeRegistry,
    cache: SnapshotCache,
    controller: Controller,
    discovery: DebugSource | None = None,
    load_reports: Callable[[], Any] | None = None,
    fleet: Callable[[], Any] | None = None,
) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(telemetry.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        if controller.ready:
            return _json({"status": "ready"})
        return _json(
            {"status": "not ready", "reason": controller.last_error or "no snapshot yet"},
            status=503,
        )

    async def nodes(_: web.Request) -> web.Response:
        return _json(
            {
                "streams": registry.to_json(),
                "load_reports": None if load_reports is None else load_reports(),
                "fleet": None if fleet is None else fleet(),
            }
        )

    async def snapshot(_: web.Request) -> web.Response:
        return _json(cache.to_json())

    async def config(_: web.Request) -> web.Response:
        current = controller.config
        return _json(
            {
                "config": None if current is None else current.model_dump(mode="json"),
                "last_error": controller.last_error,
                "kubernetes": None if discovery is None else discovery.debug(),
            }
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/debug/nodes", nodes)
    app.router.add_get("/debug/snapshot", snapshot)
    app.router.add_get("/debug/config", config)
    return app


class AdminServer:
    """Runs the admin app on `host:port` (port 0 picks a free one; see `.port`)."""

    def __init__(self, app: web.Application, *, host: str, port: int) -> None:
        self._runner = web.AppRunner(app, access_log=None)
        self._host, self._requested_port = host, port
        self.port = 0

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._requested_port).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        await self._runner.cleanup()
