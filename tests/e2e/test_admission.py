"""Flow-control admission, end to end: the server's limits (from LRS load reports, pushed
over RTDS) enforced by two real Envoys sharing one pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp

from tests.e2e.conftest import eventually
from xds_server.envoy import names, render_bootstrap
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.gateway import LocalGateway

CONCURRENCY = 2  # per pod; two pods: the pool's capacity is 4


@contextlib.asynccontextmanager
async def second_envoy(gateway: LocalGateway) -> AsyncIterator[str]:
    """Another Envoy on the same server; yields its listener URL."""
    bootstrap = render_bootstrap(
        xds_address="127.0.0.1",
        xds_port=gateway.app.xds_port,
        node_id="envoy-second",
        node_cluster="local",
        admin_port=0,
    )
    async with EnvoyProcess(bootstrap, log_level="warn") as envoy:
        await envoy.wait_live(timeout=20)
        port = await envoy.listener_port(names.LISTENER_NAME)
        yield f"http://127.0.0.1:{port}"


async def send(
    http: aiohttp.ClientSession, url: str, band: str
) -> tuple[int, str | None, bytes]:
    """A streamed request of `band`: (status, retry-after, body)."""
    body = {"model": "m", "messages": [], "stream": True}
    headers = {"x-gateway-inference-band": band}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, response.headers.get("retry-after"), await response.read()


def limit_of(gateway: LocalGateway, band: str) -> set[int] | None:
    """The `band` limits of the two Envoys (their own RTDS layers) the server decided."""
    admission = gateway.app.controller.decision.admissions.get("pool")
    if admission is None or len(admission.by_envoy) < 2:
        return None
    return {limits[band] for limits in admission.by_envoy.values()}  # type: ignore[index]


async def test_two_envoys_admit_within_the_pool_limit_by_strict_priority(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory
) -> None:
    hold = asyncio.Event()
    a = await backends("a", hold=hold, tokens=3)
    b = await backends("b", hold=hold, tokens=3)
    config_file.write(
        {"pool": (["m"], [(a, 1), (b, 1)])},
        flow_control={"enabled": True, "default_pod_concurrency": CONCURRENCY},
    )
    gateway = await gateway_factory()
    async with second_envoy(gateway) as other, aiohttp.ClientSession() as http:
        # Both Envoys report load, and neither has any yet: each enforces half of the
        # pool's capacity.
        await eventually(lambda: len(gateway.app.load_reports.nodes()) == 2, what="2 LRS streams")
        await eventually(lambda: limit_of(gateway, "standard") == {2}, what="limit 4 / 2")

        standard = [
            asyncio.create_task(send(http, url, "standard"))
            for url in (gateway.url, other)
            for _ in range(5)
        ]
        await eventually(lambda: sum(t.done() for t in standard) == 6, what="6 refusals")
        refused = [t.result() for t in standard if t.done()]
        assert all(status == 429 for status, _, _ in refused), refused
        # Admitted over both Envoys: the pool's limit (within one per Envoy).
        assert a.streams_started + b.streams_started == 4
        assert all(retry and int(retry) >= 1 for _, retry, _ in refused)
        assert b'"code":"rate_limit_exceeded"' in refused[0][2].replace(b" ", b"")
        assert b"standard" in refused[0][2]

        # The pool is full: Sheddable has no spare capacity, Critical is still admitted.
        await eventually(
            lambda: limit_of(gateway, "sheddable") == {0}, what="no spare capacity"
        )
        status, retry, _ = await send(http, gateway.url, "sheddable")
        assert status == 429 and retry is not None
        critical = asyncio.create_task(send(http, other, "critical"))
        await eventually(lambda: a.streams_started + b.streams_started == 5, what="critical in")

        hold.set()
        results = [await t for t in standard if not t.done() or t.result()[0] != 429]
        assert [status for status, _, _ in results] == [200] * 4
        assert (await critical)[0] == 200
        # The server's view, on its /metrics: capacity, limits, and refusals (from LRS).
        registry = gateway.app.telemetry.registry

        def sample(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"pool": "pool", **labels})

        assert sample("xds_pool_admission_capacity_requests") == 2 * CONCURRENCY
        assert sample("xds_band_limit", band="critical") == 1_000_000
        # The fleet-wide budget, each Envoy's part of it, and how many Envoys share it.
        assert sample("xds_band_budget", band="critical") == 1_000_000
        assert registry.get_sample_value("xds_fleet_envoys") == 2
        assert sample("xds_band_envoy_limit_min", band="critical") == 1_000_000
        assert sample("xds_band_envoy_limit_max", band="critical") == 1_000_000
        await eventually(
            lambda: (sample("xds_band_refused_total", band="sheddable") or 0) >= 1,
            what="a sheddable refusal in the metrics",
        )
