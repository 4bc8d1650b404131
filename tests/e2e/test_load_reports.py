"""LRS with a real Envoy: requests in flight on a cluster show up in the server's store
(within a few load-report intervals), go back to 0 when they finish, and their success
rate appears. Bounds are generous: CI shares its cores with other work."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import chat, eventually
from xds_server.envoy import names

POOL = "pool"


@pytest.mark.parametrize("protocol", ["sotw", "delta"])
async def test_in_flight_requests_and_rates_arrive_over_lrs(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, protocol
) -> None:
    hold = asyncio.Event()
    backend = await backends("a", hold=hold)
    config_file.write({POOL: (["m"], [(backend, 1)])})
    gateway = await gateway_factory(delta=protocol == "delta")
    reports = gateway.app.load_reports
    cluster = names.cluster_name(POOL)
    await eventually(lambda: reports.nodes(), what="Envoy's LRS stream", within_s=20)
    [node] = reports.nodes()
    assert node.node_id == "envoy-local" and node.group == "local"
    assert reports.in_progress(cluster) == 0

    started = asyncio.Queue[None]()

    async def held() -> int:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(f"{gateway.url}/v1/chat/completions", json=body) as response:
            await response.content.readline()
            started.put_nowait(None)
            await response.read()
            return response.status

    tasks = [asyncio.create_task(held()) for _ in range(3)]
    try:
        for _ in tasks:
            await asyncio.wait_for(started.get(), 10)
        await eventually(lambda: reports.in_progress(cluster) == 3, what="3 in flight", within_s=20)
        assert reports.in_progress(cluster, group="local") == 3
        assert reports.in_progress(cluster, group="elsewhere") == 0
        # Per endpoint too (report_endpoint_granularity).
        assert reports.in_progress_by_endpoint(cluster) == {f"{backend.host}:{backend.port}": 3}
        sample = gateway.app.telemetry.registry.get_sample_value(
            "xds_lrs_requests_in_progress", {"cluster": cluster}
        )
        assert sample == 3
    finally:
        hold.set()
        statuses = await asyncio.gather(*tasks)
    assert statuses == [200, 200, 200]

    await eventually(lambda: reports.in_progress(cluster) == 0, what="0 in flight", within_s=20)
    assert reports.in_progress_by_endpoint(cluster) == {}

    # Envoy 1.40 leaves a locality out of a report when the window issued no request and
    # has none in flight, dropping the successes that finished in it: the three above may
    # never be counted. Requests issued and finished within a window are.
    for _ in range(5):
        assert (await chat(http, gateway.url, "m"))[0] == 200
    await eventually(
        lambda: reports.rates(cluster).successful_per_s > 0, what="a success rate", within_s=20
    )
    rates = reports.rates(cluster)
    assert rates.issued_per_s > 0
    assert reports.rates(cluster).errors_per_s == 0
    registry = gateway.app.telemetry.registry
    assert registry.get_sample_value("xds_lrs_streams") == 1
    assert (registry.get_sample_value("xds_lrs_reports_total") or 0) > 1
