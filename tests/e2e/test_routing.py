"""A real Envoy, configured only by this server over ADS, routing OpenAI-style traffic."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.e2e.conftest import chat, eventually, served_by
from xds_server.envoy import names


@pytest.fixture(params=["sotw", "delta"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_routes_by_body_and_header_with_json_errors(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, protocol
) -> None:
    llama, qwen = await backends("llama-0"), await backends("qwen-0")
    config_file.write(
        {"llama": (["llama-3.1-8b"], [(llama, 1)]), "qwen": (["qwen3-32b"], [(qwen, 1)])}
    )
    gateway = await gateway_factory(delta=protocol == "delta")
    url = gateway.url

    assert (await chat(http, url, "llama-3.1-8b"))[:2] == (200, "llama-0")
    assert (await chat(http, url, "qwen3-32b"))[:2] == (200, "qwen-0")
    # The upstream sees the model it was routed by.
    assert qwen.last_headers[names.ROUTED_MODEL_HEADER] == "qwen3-32b"

    # The header names the model when the body does not; the body wins when both do.
    async with http.post(
        f"{url}/v1/chat/completions",
        json={"messages": []},
        headers={names.ROUTED_MODEL_HEADER: "qwen3-32b"},
    ) as response:
        assert (response.status, response.headers["x-backend-id"]) == (200, "qwen-0")
    async with http.post(
        f"{url}/v1/chat/completions",
        json={"model": "llama-3.1-8b", "messages": []},
        headers={names.ROUTED_MODEL_HEADER: "qwen3-32b"},
    ) as response:
        assert (response.status, response.headers["x-backend-id"]) == (200, "llama-0")
    assert llama.last_headers[names.ROUTED_MODEL_HEADER] == "llama-3.1-8b"

    status, backend, body = await chat(http, url, None)
    assert (status, backend) == (400, None)
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "model"

    status, _, body = await chat(http, url, "no-such-model")
    assert status == 404 and "no-such-model" in body["error"]["message"]

    async with http.post(
        f"{url}/v1/chat/completions",
        data=b"{not json",
        headers={"content-type": "application/json"},
    ) as response:
        assert response.status == 400
        assert response.headers["content-type"].startswith("application/json")
        assert "error" in json.loads(await response.read())

    # charset in the content type, and an 8 MB prompt, both pass.
    prompt = "word " * (8 * 1024 * 1024 // 5 + 1)
    async with http.post(
        f"{url}/v1/chat/completions",
        data=json.dumps(
            {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": prompt}]}
        ),
        headers={"content-type": "application/json; charset=utf-8"},
    ) as response:
        assert (response.status, response.headers["x-backend-id"]) == (200, "llama-0")
    assert llama.last_request.body_size > 8 * 1024 * 1024


async def test_sse_streams_chunk_by_chunk(backends, config_file, gateway_factory, http) -> None:  # type: ignore[no-untyped-def]
    hold = asyncio.Event()
    backend = await backends("llama-0", hold=hold, tokens=4)
    config_file.write({"llama": (["llama-3.1-8b"], [(backend, 1)])})
    gateway = await gateway_factory()
    body = {
        "model": "llama-3.1-8b",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    async with http.post(f"{gateway.url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
        # The backend has not finished: the first chunk came through Envoy on its own.
        assert first.startswith(b"data: {") and backend.streams_finished == 0
        hold.set()
        rest = await asyncio.wait_for(response.content.read(), 5)
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert backend.streams_finished == 1


async def _cluster_weights(gateway, cluster: str) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """Envoy's view, from admin /clusters: endpoint port -> weight."""
    clusters = await gateway.envoy.clusters_json()
    for status in clusters.get("cluster_statuses", []):
        if status["name"] == cluster:
            return {
                h["address"]["socket_address"]["port_value"]: h.get("weight", 1)
                for h in status.get("host_statuses", [])
            }
    return {}


async def test_weight_change_shifts_split_without_failing_inflight(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, protocol
) -> None:
    hold = asyncio.Event()
    a = await backends("a", hold=hold, tokens=3)
    b = await backends("b", hold=hold, tokens=3)
    config_file.write({"pool": (["m"], [(a, 1), (b, 1)])})
    gateway = await gateway_factory(delta=protocol == "delta")

    async def streamed() -> tuple[int, bytes]:
        body = {"model": "m", "messages": [], "stream": True}
        async with http.post(f"{gateway.url}/v1/chat/completions", json=body) as response:
            return response.status, await response.read()

    def responses() -> dict[str, float]:
        registry = gateway.app.telemetry.registry
        return {
            t: registry.get_sample_value("xds_responses_total", {"type": t}) or 0
            for t in ("cds", "eds", "lds", "rds")
        }

    in_flight = [asyncio.create_task(streamed()) for _ in range(8)]
    await eventually(lambda: a.streams_started + b.streams_started == 8, what="8 streams in flight")
    before = responses()
    config_file.write({"pool": (["m"], [(a, 9), (b, 1)])})
    await eventually(
        lambda: _check_weights(gateway, {a.port: 9, b.port: 1}),
        what="Envoy to apply the new weights",
    )
    # A weight change is an EDS-only push: clusters, listeners and routes are not re-sent.
    after = responses()
    assert after["eds"] == before["eds"] + 1
    assert {t: after[t] for t in ("cds", "lds", "rds")} == {
        t: before[t] for t in ("cds", "lds", "rds")
    }
    hold.set()
    for status, payload in await asyncio.gather(*in_flight):
        assert status == 200 and payload.rstrip().endswith(b"data: [DONE]")

    tally = await served_by(http, gateway.url, "m", 300)
    assert set(tally) <= {"a", "b"}, tally
    assert tally.get("a", 0) / 300 > 0.75, tally


async def _check_weights(gateway, expected: dict[int, int]) -> bool:  # type: ignore[no-untyped-def]
    return await _cluster_weights(gateway, "pool") == expected


async def test_removed_endpoint_stops_receiving_traffic(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    a, b = await backends("a"), await backends("b")
    config_file.write({"pool": (["m"], [(a, 1), (b, 1)])})
    gateway = await gateway_factory()
    assert set(await served_by(http, gateway.url, "m", 60)) == {"a", "b"}
    config_file.write({"pool": (["m"], [(a, 1)])})
    await eventually(lambda: _check_weights(gateway, {a.port: 1}), what="Envoy to drop endpoint b")
    before = b.request_count
    assert await served_by(http, gateway.url, "m", 100) == {"a": 100}
    assert b.request_count == before


async def test_round_robin_pool_alternates(backends, config_file, gateway_factory, http) -> None:  # type: ignore[no-untyped-def]
    a, b = await backends("a"), await backends("b")
    config_file.write({"pool": (["m"], [(a, 1), (b, 1)])}, balancing="round_robin")
    gateway = await gateway_factory()
    order = [(await chat(http, gateway.url, "m"))[1] for _ in range(20)]
    # One request at a time: round robin alternates strictly (least request would pick
    # between two idle hosts at random).
    assert all(order[i] != order[i + 1] for i in range(19)), order
