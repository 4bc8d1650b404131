"""RTDS with a real Envoy: a runtime key pushed over ADS changes a cluster's admission limit
at once, without a CDS push and without dropping a connection.

The cluster is the session cluster `pool/session`: its name holds a '/', as the per-band
clusters' names (`<pool>/<band>`) will, and Envoy takes the whole name in the runtime key
`circuit_breakers.pool/session.default.max_requests`. A request over `max_requests` is
refused at once: 503 with `x-envoy-overloaded: true` (response flag UO), counted in
`cluster.<name>.upstream_rq_active_overflow` (not `upstream_rq_pending_overflow`, which is
`max_pending_requests`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import yaml

from tests.e2e.conftest import eventually
from xds_server.envoy import build_runtime, names
from xds_server.xds.resources import ResourceType
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.gateway import LocalGateway

POOL = "pool"
CLUSTER = names.session_cluster_name(POOL)
KEY = f"circuit_breakers.{CLUSTER}.default.max_requests"


def _write_config(path: Any, backend: Any) -> None:
    document = {
        "listener": {"address": "127.0.0.1", "port": 0},
        "updates": {"debounce_s": 0.02, "max_delay_s": 0.2},
        "pools": [
            {
                "name": POOL,
                "models": ["m"],
                "gpu_aware": False,
                "session_affinity": True,
                "endpoints": [{"address": backend.host, "port": backend.port, "weight": 1}],
            }
        ],
    }
    path.write_text(yaml.safe_dump(document))


async def _push_limit(gateway: LocalGateway, limit: int) -> None:
    """Serve `KEY = limit` in the RTDS layer and wait until Envoy has it in force."""
    snapshot = gateway.app.controller.snapshot
    assert snapshot is not None
    gateway.app.cache.set_snapshot(
        snapshot.replace(ResourceType.RUNTIME, build_runtime({KEY: limit}))
    )
    await eventually(
        lambda: _runtime_value(gateway.envoy), what=f"Envoy to take {KEY}={limit}", within_s=20
    )
    assert await _runtime_value(gateway.envoy) == str(limit)


async def _runtime_value(envoy: EnvoyProcess) -> str | None:
    """KEY's value in the server's RTDS layer, as admin /runtime shows it."""
    runtime = json.loads(await envoy.admin_get("/runtime"))
    entry = runtime["entries"].get(KEY)
    if entry is None:
        return None
    value: str = entry["layer_values"][runtime["layers"].index(names.RUNTIME_LAYER_NAME)]
    return value


async def _held_requests(
    http: aiohttp.ClientSession, gateway: LocalGateway, hold: asyncio.Event, count: int
) -> list[tuple[int, str | None]]:
    """Send `count` keyed streaming requests at once; the backend holds each after its first
    chunk until `hold` is set. Returns (status, x-envoy-overloaded) of each, once all have
    either started streaming or been refused, then lets them finish."""
    started: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def one() -> None:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        headers = {names.SESSION_HEADER: "one-key"}
        async with http.post(
            f"{gateway.url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status == 200:
                await response.content.readline()
            started.put_nowait((response.status, response.headers.get("x-envoy-overloaded")))
            await response.read()

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    try:
        results = [await asyncio.wait_for(started.get(), 10) for _ in range(count)]
    finally:
        hold.set()
        await asyncio.gather(*tasks)
        hold.clear()
    return sorted(results)


async def _stats(envoy: EnvoyProcess) -> dict[str, int]:
    names_ = [
        "cluster_manager.cds.update_attempt",
        "cluster_manager.cds.update_success",
        f"cluster.{CLUSTER}.upstream_cx_destroy",
        f"cluster.{CLUSTER}.upstream_rq_active_overflow",
        f"cluster.{CLUSTER}.upstream_rq_pending_overflow",
    ]
    stats = await envoy.get_stats("^(cluster_manager.cds|cluster.pool/session.upstream_)")
    return {name: stats[name] for name in names_}


@pytest.mark.parametrize("protocol", ["sotw", "delta"])
async def test_a_runtime_limit_changes_admission_without_a_cds_push(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, protocol
) -> None:
    hold = asyncio.Event()
    backend = await backends("a", hold=hold)
    _write_config(config_file.path, backend)
    gateway = await gateway_factory(delta=protocol == "delta")
    app, envoy = gateway.app, gateway.envoy
    runtime = json.loads(await envoy.admin_get("/runtime"))
    assert runtime["layers"] == ["static", names.RUNTIME_LAYER_NAME, "admin"]

    await _push_limit(gateway, 2)
    cds_responses = app.telemetry.registry.get_sample_value("xds_responses_total", {"type": "cds"})
    before = await _stats(envoy)

    # Limit 2: of three concurrent requests, exactly one is refused with UO.
    assert await _held_requests(http, gateway, hold, 3) == [(200, None), (200, None), (503, "true")]
    after_first = await _stats(envoy)
    assert after_first[f"cluster.{CLUSTER}.upstream_rq_active_overflow"] == 1
    assert after_first[f"cluster.{CLUSTER}.upstream_rq_pending_overflow"] == 0

    # Limit 3, pushed over RTDS only: all three go through.
    await _push_limit(gateway, 3)
    assert await _held_requests(http, gateway, hold, 3) == [(200, None)] * 3
    after = await _stats(envoy)
    assert after[f"cluster.{CLUSTER}.upstream_rq_active_overflow"] == 1

    # No CDS push, no cluster update in Envoy, no upstream connection closed.
    assert (
        app.telemetry.registry.get_sample_value("xds_responses_total", {"type": "cds"})
        == cds_responses
    )
    for name in (
        "cluster_manager.cds.update_attempt",
        "cluster_manager.cds.update_success",
        f"cluster.{CLUSTER}.upstream_cx_destroy",
    ):
        assert after[name] == before[name], name
    [record] = app.registry.streams()
    entry = app.cache.entry_for("local")
    assert entry is not None
    assert record.acked["rtds"] == entry.snapshot.versions[ResourceType.RUNTIME]
    assert record.nacks == 0
