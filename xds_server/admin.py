"""The server's HTTP endpoints, on two listeners that are exposed differently.

The admin listener (`make_admin_app`; `--admin-address`, `--admin-port`, 9000) is for
machines: the kubelet's probes and Prometheus. On Kubernetes it listens on 0.0.0.0 behind
the Service, and a NetworkPolicy admits only the monitoring namespace (k8s/README.md).

/metrics         the server's Prometheus metrics (telemetry.py)
/healthz         200 while the process serves (liveness)
/readyz          200 once a snapshot is in the cache, else 503 with the reason (readiness);
                 the 200 says "degraded" while a pool has no healthy endpoint and names
                 those pools, else "ready" (`readiness`)

Why a pool without healthy endpoints leaves /readyz at 200: readiness says whether this
replica can serve config, and it can. Kubernetes takes an unready replica out of its
Service, which is how Envoys reach the control plane; a pool emptied by the config every
replica shares would make them all unready at once, and cut every Envoy off from config
for every model, the fix for that pool included. The pool is named in the 200 instead, and
`xds_pool_healthy_endpoints` (telemetry/pools.py) at 0 is what an alert fires on.

The debug listener (`make_debug_app`; `--debug-address`, `--debug-port`) is for an
operator. It listens on 127.0.0.1 unless told otherwise, on the admin port + 1 (9001) by
default (`default_debug_port`; 0 picks a free port, as tests do).

/debug/nodes     connected Envoys: node, versions sent and ACKed per type, last NACK, and
                 their latest load reports (LRS) per cluster; the fleet: this replica's
                 peers, every Envoy the policy counts (and where it was heard of), its
                 limits per pool and band, and each band's fleet-wide budget
/debug/snapshot  the snapshot of every group: versions and resource names; and the
                 versions of each Envoy that has its own admission limits
/debug/decision  every GPU-aware pool's endpoint states (weight, health, spill, adapters)
                 with the reasons the policy gave for each, figures included (`?pool=`
                 for one pool), and the bounded set of reason codes metrics label with
/debug/config    the routing config in force, the last config error, why spilled keys go
                 to the ring if an Envoy refused a spill listener, and on Kubernetes the
                 watches, objectives and objects that could not be used

Why two listeners: the debug views show the whole routing config, every Envoy's node id
and load, and the peers' addresses, to anyone who can connect, with no authentication.
Prometheus needs none of it. On loopback they are reachable from inside the pod only,
which is where `kubectl port-forward` connects (the same arrangement as Envoy's own admin
interface on 127.0.0.1:9901), so seeing them takes the `pods/portforward` permission
rather than a route to the pod. `--debug-address 0.0.0.0` opens them deliberately.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from xds_server.clock import to_thread
from xds_server.controller import Controller
from xds_server.policy.reasons import CODES
from xds_server.telemetry import Telemetry
from xds_server.telemetry.bands import DecisionView
from xds_server.telemetry.pools import healthy_endpoints
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.nodes import NodeRegistry

__all__ = [
    "AdminServer",
    "DebugSource",
    "ReadinessView",
    "default_debug_port",
    "make_admin_app",
    "make_debug_app",
    "readiness",
]


def _json(payload: Any, *, status: int = 200) -> web.Response:
    return web.json_response(
        payload, status=status, dumps=lambda o: json.dumps(o, indent=2, sort_keys=True)
    )


async def _json_off_loop(payload: Any) -> web.Response:
    """`_json`, encoded in a worker thread: a debug view of a large fleet is megabytes."""
    body = await to_thread(json.dumps, payload, indent=2, sort_keys=True)
    return web.Response(text=body, content_type="application/json")


class DebugSource(Protocol):
    """Something with more to show on /debug/config (Kubernetes discovery)."""

    def debug(self) -> dict[str, Any]: ...


class ReadinessView(DecisionView, Protocol):
    """What /readyz reads (the controller): whether a snapshot is in force, the error of
    the last config or build that failed since a config was accepted, and the config and
    decision in force."""

    @property
    def ready(self) -> bool: ...

    @property
    def last_error(self) -> str | None: ...


def readiness(view: ReadinessView) -> tuple[int, dict[str, Any]]:
    """/readyz's status code and body. 503 `not ready`, with the reason, before the first
    snapshot. Then 200: `degraded` while some pool of the config in force has no healthy
    endpoint (`pools_without_healthy_endpoints`, in config order; telemetry/pools.py says
    what counts as healthy), else `ready`; and `last_error`, None unless a config was
    refused (or could not be built) since the last one accepted, which stays in force."""
    if not view.ready:
        return 503, {"status": "not ready", "reason": view.last_error or "no snapshot yet"}
    empty = [name for name, count in healthy_endpoints(view).items() if count == 0]
    return 200, {
        "status": "degraded" if empty else "ready",
        "pools_without_healthy_endpoints": empty,
        "last_error": view.last_error,
    }


def default_debug_port(admin_port: int) -> int:
    """The debug listener's port when none is given: the admin port + 1 (9001 next to the
    default 9000), and 0, a free port, when the admin port is 0 (tests)."""
    return admin_port + 1 if admin_port else 0


def make_admin_app(
    *,
    telemetry: Telemetry,
    controller: Controller,
    registry: NodeRegistry | None = None,
    cache: SnapshotCache | None = None,
    discovery: DebugSource | None = None,
    load_reports: Callable[[], Any] | None = None,
    fleet: Callable[[str | None], Any] | None = None,
) -> web.Application:
    """The admin listener's app: /metrics, /healthz and /readyz; nothing under /debug.

    Deprecated: `registry`, `cache`, `discovery`, `load_reports` and `fleet` are accepted
    and ignored, so that the current XdsApplication keeps starting; they belong to
    `make_debug_app`. TODO(app.py owner): drop them once XdsApplication builds the debug
    listener.
    """
    del registry, cache, discovery, load_reports, fleet

    async def metrics(_: web.Request) -> web.Response:
        # In a worker thread: at fleet size the page is thousands of series (60-120 ms of
        # prometheus-client), which would hold the event loop; a thread hands the loop the
        # interpreter every few milliseconds. The collectors read immutable decisions and
        # copies of what the loop changes.
        body = await to_thread(generate_latest, telemetry.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        status, body = readiness(controller)
        return _json(body, status=status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def make_debug_app(
    *,
    registry: NodeRegistry,
    cache: SnapshotCache,
    controller: Controller,
    discovery: DebugSource | None = None,
    load_reports: Callable[[], Any] | None = None,
    fleet: Callable[[str | None], Any] | None = None,
) -> web.Application:
    """The debug listener's app: /debug/nodes, /debug/snapshot and /debug/config (see the
    module docstring). `discovery` None shows `"kubernetes": null`; `load_reports` and
    `fleet` None show `null` for the Envoys' load reports and for the fleet. Serve it on
    loopback unless the operator asked otherwise."""

    async def nodes(request: web.Request) -> web.Response:
        node = request.query.get("node")
        streams = registry.to_json()
        reports = None if load_reports is None else load_reports()
        if node is not None:
            streams = [s for s in streams if s.get("node_id") == node]
            reports = None if reports is None else [r for r in reports if r.get("node_id") == node]
        return await _json_off_loop(
            {
                "streams": streams,
                "load_reports": reports,
                "fleet": None if fleet is None else fleet(node),
            }
        )

    async def snapshot(_: web.Request) -> web.Response:
        return _json(cache.to_json())

    async def decision(request: web.Request) -> web.Response:
        wanted = request.query.get("pool")
        decided = controller.decision
        return await _json_off_loop(
            {
                "pools": {
                    name: [endpoint.to_json() for endpoint in state.endpoints]
                    for name, state in decided.pools.items()
                    if wanted is None or name == wanted
                },
                "reason_codes": list(CODES),
            }
        )

    async def config(_: web.Request) -> web.Response:
        current = controller.config
        return _json(
            {
                "config": None if current is None else current.model_dump(mode="json"),
                "last_error": controller.last_error,
                "spill_fallback": controller.spill_fallback,
                "kubernetes": None if discovery is None else discovery.debug(),
            }
        )

    app = web.Application()
    app.router.add_get("/debug/nodes", nodes)
    app.router.add_get("/debug/snapshot", snapshot)
    app.router.add_get("/debug/decision", decision)
    app.router.add_get("/debug/config", config)
    return app


class AdminServer:
    """Runs one of these apps on `host:port` (port 0 picks a free one). After `start()`,
    `host` and `port` are the address actually bound; `stop()` closes it."""

    def __init__(self, app: web.Application, *, host: str, port: int) -> None:
        self._runner = web.AppRunner(app, access_log=None)
        self._requested = (host, port)
        self.host = host
        self.port = 0

    async def start(self) -> None:
        """Bind and serve; raises OSError when the address cannot be bound."""
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, *self._requested).start()
        except OSError:
            await self._runner.cleanup()
            raise
        host, port = self._runner.addresses[0][:2]
        self.host, self.port = str(host), int(port)

    async def stop(self) -> None:
        await self._runner.cleanup()
