"""Flow control through a real Envoy: classification into bands, admission by each band
cluster's circuit breaker, the 429 with Retry-After, the distinct 503, band-aware splits.

Limits are set the way the policy sets them, as the runtime key
`circuit_breakers.<band cluster>.default.max_requests`, here through Envoy's admin runtime
layer (`POST /runtime_modify`): the change is a runtime change only, no CDS push.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from tests.e2e.conftest import chat, served_by
from xds_server.config import BANDS
from xds_server.envoy import names
from xds_testbed import EnvoyProcess

OBJECTIVES = {"batch": -1, "chat": 0, "urgent": 5}
BAND_HEADER = "x-gateway-inference-band"


def _flow_control(**extra: Any) -> dict[str, Any]:
    return {"enabled": True, "objectives": OBJECTIVES, **extra}


async def _band_totals(envoy: EnvoyProcess, pool: str) -> dict[str, int]:
    stats = await envoy.get_stats(rf"^cluster\.{pool}/[a-z]+\.upstream_rq_total$")
    return {
        b: stats.get(f"cluster.{names.band_cluster_name(pool, b)}.upstream_rq_total", 0)
        for b in BANDS
    }


async def _served_band(
    http: aiohttp.ClientSession,
    url: str,
    envoy: EnvoyProcess,
    *,
    model: str,
    headers: Mapping[str, str],
    pool: str = "llama",
) -> str:
    """Send one request; the band whose cluster served it (exactly one must have)."""
    before = await _band_totals(envoy, pool)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
    after = await _band_totals(envoy, pool)
    (band,) = [b for b in BANDS if after[b] != before[b]]
    return band


async def _set_limit(
    envoy: EnvoyProcess, http: aiohttp.ClientSession, cluster: str, limit: int
) -> None:
    key = f"circuit_breakers.{cluster}.default.max_requests"
    async with http.post(f"{envoy.admin_url}/runtime_modify", params={key: str(limit)}) as response:
        assert response.status == 200, await response.text()


async def _route_metadata(envoy: EnvoyProcess, route_name: str) -> dict[str, Any]:
    """The `llm` route metadata of the route named `route_name`, as Envoy holds it."""
    dump = await envoy.config_dump(resource="dynamic_route_configs")
    for config in dump["configs"]:
        for host in config["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                if route.get("name") == route_name:
                    result: dict[str, Any] = route["metadata"]["filter_metadata"][
                        names.METADATA_NAMESPACE
                    ]
                    return result
    raise AssertionError(f"Envoy has no route {route_name!r}")


async def test_bands_by_objective_band_header_and_model_default_capped(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    backend = await backends("llama-0")
    config_file.write(
        {"llama": (["llama", "capped"], [(backend, 1)])},
        flow_control=_flow_control(
            models={"capped": {"default_band": "sheddable", "max_band": "standard"}}
        ),
    )
    gateway = await gateway_factory()
    obj, band = names.OBJECTIVE_HEADER, BAND_HEADER
    cases: list[tuple[str, dict[str, str], str]] = [
        ("llama", {}, "standard"),  # no header: the default band
        ("llama", {obj: "urgent"}, "critical"),  # priority > 0
        ("llama", {obj: "chat"}, "standard"),  # priority 0
        ("llama", {obj: "batch", band: "critical"}, "sheddable"),  # the objective wins
        ("llama", {obj: "no-such-objective", band: "critical"}, "critical"),  # falls through
        ("llama", {band: "Sheddable"}, "sheddable"),  # case-insensitive
        ("llama", {band: "bogus"}, "standard"),
        ("capped", {}, "sheddable"),  # the model's default
        ("capped", {band: "critical"}, "standard"),  # capped at max_band
        ("capped", {obj: "urgent"}, "standard"),
        ("capped", {band: "standard"}, "standard"),
    ]
    for model, headers, expected in cases:
        served = await _served_band(http, gateway.url, gateway.envoy, model=model, headers=headers)
        assert served == expected, (model, headers)
    # The model named by header instead of the body is classified the same way.
    before = await _band_totals(gateway.envoy, "llama")
    async with http.post(
        f"{gateway.url}/v1/chat/completions",
        json={"messages": []},
        headers={names.ROUTED_MODEL_HEADER: "llama", obj: "batch"},
    ) as response:
        assert response.status == 200
    assert (await _band_totals(gateway.envoy, "llama"))["sheddable"] == before["sheddable"] + 1


async def test_a_full_band_answers_429_with_retry_after_and_never_reaches_a_pod(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    hold = asyncio.Event()
    backend = await backends("llama-0", hold=hold, tokens=4)
    config_file.write(
        {"llama": (["llama"], [(backend, 1)])},
        flow_control=_flow_control(retry_after_min_s=3, retry_after_max_s=30),
    )
    gateway = await gateway_factory()
    envoy = gateway.envoy
    await _set_limit(envoy, http, names.band_cluster_name("llama", "sheddable"), 1)
    sheddable = {names.OBJECTIVE_HEADER: "batch"}
    body = {"model": "llama", "messages": [], "stream": True}

    held = await http.post(f"{gateway.url}/v1/chat/completions", json=body, headers=sheddable)
    try:
        assert held.status == 200
        await held.content.readline()  # the first chunk: the request is in flight
        seen = backend.request_count
        async with http.post(
            f"{gateway.url}/v1/chat/completions", json=body, headers=sheddable
        ) as refused:
            status, retry_after = refused.status, refused.headers.get("retry-after")
            error = json.loads(await refused.read())["error"]
        assert status == 429
        metadata = await _route_metadata(envoy, "model/llama/sheddable/objective/batch")
        assert metadata[names.BAND_KEY] == "sheddable"
        assert retry_after == str(int(metadata[names.RETRY_AFTER_KEY]))
        assert 3 <= int(retry_after) <= 30
        assert error["code"] == "rate_limit_exceeded"
        assert error["type"] == names.RATE_LIMIT_ERROR_TYPE
        assert error["message"] == (
            f"The sheddable band of pool llama is full; retry after {retry_after} s."
        )
        assert backend.request_count == seen  # refused before any model server saw it
        overflow = await envoy.get_stats(r"upstream_rq_active_overflow$")
        assert overflow["cluster.llama/sheddable.upstream_rq_active_overflow"] == 1
        # Other bands have their own limits.
        assert (await chat(http, gateway.url, "llama"))[:2] == (200, "llama-0")
    finally:
        hold.set()
        await held.read()
        held.release()


async def test_raising_a_limit_under_load_fails_nothing_and_drops_no_connection(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    hold = asyncio.Event()
    backend = await backends("llama-0", hold=hold, tokens=4)
    config_file.write({"llama": (["llama"], [(backend, 1)])}, flow_control=_flow_control())
    gateway = await gateway_factory()
    envoy = gateway.envoy
    cluster = names.band_cluster_name("llama", "sheddable")
    await _set_limit(envoy, http, cluster, 4)
    sheddable = {names.OBJECTIVE_HEADER: "batch"}
    stream = {"model": "llama", "messages": [], "stream": True}
    url = f"{gateway.url}/v1/chat/completions"

    async def streamed() -> bytes:
        async with http.post(url, json=stream, headers=sheddable) as response:
            assert response.status == 200
            return await response.read()

    in_flight = [asyncio.create_task(streamed()) for _ in range(4)]
    await _wait_for(lambda: backend.streams_started == 4)
    before = await envoy.get_stats(r"(cds\.update_success|upstream_cx_destroy$|remaining_rq$)")
    remaining = f"cluster.{cluster}.circuit_breakers.default.remaining_rq"
    assert before[remaining] == 0
    assert before["cluster_manager.cds.update_success"] >= 1
    assert before[f"cluster.{cluster}.upstream_cx_destroy"] == 0

    await _set_limit(envoy, http, cluster, 50)  # while 4 are in flight
    statuses = await asyncio.gather(
        *(chat(http, gateway.url, "llama") for _ in range(10)),
        *(_status(http, url, sheddable) for _ in range(20)),
    )
    assert [s if isinstance(s, int) else s[0] for s in statuses] == [200] * 30
    after = await envoy.get_stats(r"(cds\.update_success|upstream_cx_destroy$|remaining_rq$)")
    # The in-flight requests still count against the new limit: the count was not reset.
    assert after[remaining] == 50 - 4
    hold.set()
    bodies = await asyncio.gather(*in_flight)
    assert all(body.rstrip().endswith(b"data: [DONE]") for body in bodies)
    final = await envoy.get_stats(r"(cds\.update_success|upstream_cx_destroy$)")
    # No cluster update and no upstream connection closed: only a runtime key changed.
    assert final == {k: v for k, v in before.items() if not k.endswith("remaining_rq")}


async def test_no_ready_pod_is_a_distinct_503(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    backend = await backends("llama-0")
    config_file.write(
        {"llama": (["llama"], [(backend, 1)]), "empty": (["ghost"], [])},
        flow_control=_flow_control(),
    )
    gateway = await gateway_factory()
    body = {"model": "ghost", "messages": []}
    for headers in ({}, {names.OBJECTIVE_HEADER: "batch"}, {BAND_HEADER: "critical"}):
        async with http.post(
            f"{gateway.url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            assert response.status == 503
            assert "retry-after" not in response.headers
            error = json.loads(await response.read())["error"]
        assert error["code"] == "no_healthy_upstream"
        assert error["type"] == "server_error"
    # Errors unrelated to bands keep their codes.
    assert (await chat(http, gateway.url, "no-such-model"))[0] == 404
    assert (await chat(http, gateway.url, None))[0] == 400


async def test_split_is_band_aware(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    stable, canary = await backends("stable-0"), await backends("canary-0")
    config_file.write(
        {"stable": (["llama-v1"], [(stable, 1)]), "canary": (["llama-v2"], [(canary, 1)])},
        model_rewrites=[
            {
                "model": "llama",
                "targets": [
                    {"model": "llama-v1", "weight": 80},
                    {"model": "llama-v2", "weight": 20},
                ],
            }
        ],
        flow_control=_flow_control(models={"llama": {"default_band": "sheddable"}}),
    )
    gateway = await gateway_factory()
    tally = await served_by(http, gateway.url, "llama", 1000)
    assert set(tally) == {"stable-0", "canary-0"}, tally
    assert abs(tally["canary-0"] / 1000 - 0.20) <= 0.05, tally
    # All of them went through the sheddable clusters (the model's default band).
    stable_bands = await _band_totals(gateway.envoy, "stable")
    canary_bands = await _band_totals(gateway.envoy, "canary")
    assert stable_bands["sheddable"] == tally["stable-0"]
    assert canary_bands["sheddable"] == tally["canary-0"]
    assert stable_bands["critical"] == canary_bands["critical"] == 0
    # An objective picks the band on whichever target the split chose.
    urgent = {names.OBJECTIVE_HEADER: "urgent"}
    assert await _status(http, f"{gateway.url}/v1/chat/completions", urgent) == 200
    critical = (await _band_totals(gateway.envoy, "stable"))["critical"] + (
        await _band_totals(gateway.envoy, "canary")
    )["critical"]
    assert critical == 1


async def _status(http: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> int:
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(url, json=body, headers=headers) as response:
        await response.read()
        return response.status


async def _wait_for(predicate: Any, within_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_session_keyed_requests_are_admitted_per_band(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    one, two = await backends("llama-0"), await backends("llama-1")
    config_file.write(
        {"llama": (["llama"], [(one, 1), (two, 1)])},
        flow_control=_flow_control(),
        session_affinity=["llama"],
    )
    gateway = await gateway_factory()
    session = names.band_cluster_name("llama", "sheddable", "session")
    await _set_limit(gateway.envoy, http, session, 0)
    keyed = {names.SESSION_HEADER: "conversation-1", names.OBJECTIVE_HEADER: "batch"}
    assert await _status(http, f"{gateway.url}/v1/chat/completions", keyed) == 429
    # Other bands' session clusters admit, and stay sticky.
    keyed[names.OBJECTIVE_HEADER] = "urgent"
    served = {(await _chat_with(http, gateway.url, keyed)) for _ in range(5)}
    assert len(served) == 1, served
    stats = await gateway.envoy.get_stats(r"^cluster\.llama/session/[a-z]+\.upstream_rq_total$")
    critical = names.band_cluster_name("llama", "critical", "session")
    assert stats[f"cluster.{critical}.upstream_rq_total"] == 5
    assert stats.get(f"cluster.{session}.upstream_rq_total", 0) == 0


async def _chat_with(http: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> str:
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status == 200
        return response.headers["x-backend-id"]
