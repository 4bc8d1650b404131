"""A pool emptied by a config edit, through a real Envoy: refused while the old endpoints
keep serving, and applied only when the pool says `allow_empty`, at which point /readyz
and xds_pool_healthy_endpoints name the pool its models' 503s come from."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.e2e.conftest import chat, eventually, served_by
from xds_testbed.gateway import LocalGateway


async def _readyz(http: aiohttp.ClientSession, gateway: LocalGateway) -> tuple[int, Any]:
    async with http.get(f"http://127.0.0.1:{gateway.app.admin_port}/readyz") as response:
        return response.status, await response.json()


async def test_an_edit_that_empties_a_pool_is_refused_unless_the_pool_allows_it(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    llama, qwen = await backends("llama-0"), await backends("qwen-0")
    config_file.write({"llama": (["llama"], [(llama, 1)]), "qwen": (["qwen"], [(qwen, 1)])})
    gateway = await gateway_factory()
    registry = gateway.app.telemetry.registry

    def healthy(pool: str) -> float | None:
        return registry.get_sample_value("xds_pool_healthy_endpoints", {"pool": pool})

    def refusals() -> float:
        return registry.get_sample_value("xds_config_reloads_total", {"result": "error"}) or 0

    assert await served_by(http, gateway.url, "llama", 10) == {"llama-0": 10}
    assert (await _readyz(http, gateway))[1]["status"] == "ready"
    assert healthy("llama") == 1

    # The llama pool's only endpoint taken away: refused, and Envoy keeps it.
    config_file.write({"llama": (["llama"], []), "qwen": (["qwen"], [(qwen, 1)])})
    await eventually(lambda: refusals() == 1, within_s=60, what="the refusal")
    assert await served_by(http, gateway.url, "llama", 20) == {"llama-0": 20}
    status, body = await _readyz(http, gateway)
    assert (status, body["status"], body["pools_without_healthy_endpoints"]) == (200, "ready", [])
    assert "'llama' (had 1)" in body["last_error"]
    assert healthy("llama") == 1

    # The pool says so: applied; its models get 503 no_healthy_upstream, and readiness
    # (still 200: the server serves config) names the pool.
    config_file.write(
        {"llama": (["llama"], []), "qwen": (["qwen"], [(qwen, 1)])}, allow_empty=["llama"]
    )

    async def unavailable() -> bool:
        return (await chat(http, gateway.url, "llama"))[0] == 503

    await eventually(unavailable, within_s=60, what="the empty pool to reach Envoy")
    status, _, answer = await chat(http, gateway.url, "llama")
    assert (status, answer["error"]["code"]) == (503, "no_healthy_upstream")
    assert (await chat(http, gateway.url, "qwen"))[:2] == (200, "qwen-0")
    assert await _readyz(http, gateway) == (
        200,
        {"status": "degraded", "pools_without_healthy_endpoints": ["llama"], "last_error": None},
    )
    assert (healthy("llama"), healthy("qwen")) == (0, 1)

    # An endpoint back: served, and ready again.
    config_file.write({"llama": (["llama"], [(llama, 1)]), "qwen": (["qwen"], [(qwen, 1)])})

    async def served() -> bool:
        return (await chat(http, gateway.url, "llama"))[:2] == (200, "llama-0")

    await eventually(served, within_s=60, what="the endpoint to be back")
    await eventually(
        lambda: healthy("llama") == 1, within_s=60, what="the gauge to count the endpoint"
    )
    assert (await _readyz(http, gateway))[1]["status"] == "ready"
    assert refusals() == 1
