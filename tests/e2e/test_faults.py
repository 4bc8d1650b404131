"""Pod failures through a real Envoy: what is retried on another pod, what is ejected, and
the JSON every client sees when nothing could save its request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import chat
from xds_testbed.faults import Fault, FaultyServer


async def _post(http: aiohttp.ClientSession, url: str) -> tuple[int, Any, dict[str, Any]]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.content_type == "application/json", await response.text()
        return response.status, response.headers, json.loads(await response.read())


@pytest.mark.parametrize("fault", [Fault.REFUSE, Fault.RESET])
async def test_a_request_the_pod_fails_before_answering_is_served_by_another_once(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, fault
) -> None:
    good = await backends("good", models=["m"])
    async with FaultyServer(fault) as bad:
        config_file.write({"p": (["m"], [(good, 1), (bad, 1)])}, balancing="round_robin")
        gateway = await gateway_factory()
        answers = [await chat(http, gateway.url, "m") for _ in range(12)]
        assert [(status, backend) for status, backend, _ in answers] == [(200, "good")] * 12
        # Each request reached the good pod exactly once: retried, never duplicated.
        assert len(good.requests) == 12
        stats = await gateway.envoy.get_stats(r"cluster\.p\.(upstream_rq_retry$|outlier)")
        ejections = stats["cluster.p.outlier_detection.ejections_enforced_total"]
        if fault is Fault.REFUSE:
            # Three refused connections in a row eject the pod from this Envoy's rotation,
            # so only those three requests needed a retry.
            assert ejections == 1
            assert 1 <= stats["cluster.p.upstream_rq_retry"] <= 3
        else:
            # Every request the pod reset was retried once. Envoy 1.40 does not eject a pod
            # that accepts connections and then resets them (each new connection counts as
            # a success again); the server takes it out when its scrapes fail the same way.
            assert bad.requests >= 1
            assert stats["cluster.p.upstream_rq_retry"] == bad.requests
            assert ejections == 0


async def test_a_pod_that_never_answers_times_out_with_a_json_504(  # type: ignore[no-untyped-def]
    config_file, gateway_factory, http
) -> None:
    async with FaultyServer(Fault.HANG) as stuck:
        config_file.write({"p": (["m"], [(stuck, 1)])}, request_timeout_s=1.0)
        gateway = await gateway_factory()
        status, headers, body = await _post(http, gateway.url)
    assert status == 504
    assert body["error"]["code"] == "upstream_timeout"
    assert body["error"]["type"] == "server_error"
    assert "retry-after" not in headers
    # Not retried: a timeout is not a failure before headers that another pod can undo.
    assert stuck.requests == 1


@pytest.mark.parametrize("fault", [Fault.REFUSE, Fault.RESET])
async def test_when_every_pod_fails_the_client_gets_a_json_503_with_retry_after(  # type: ignore[no-untyped-def]
    config_file, gateway_factory, http, fault
) -> None:
    async with FaultyServer(fault) as bad:
        config_file.write({"p": (["m"], [(bad, 1)])})
        gateway = await gateway_factory()
        status, headers, body = await _post(http, gateway.url)
    assert status == 503
    assert headers["retry-after"] == "1"
    assert body["error"]["code"] == "upstream_unavailable"
    assert body["error"]["type"] == "server_error"
    assert body["error"]["message"].startswith("The model server failed before answering")


async def test_a_full_pool_circuit_breaker_is_a_json_503_overloaded(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    hold = asyncio.Event()
    backend = await backends("a", models=["m"], hold=hold)
    config_file.write({"p": (["m"], [(backend, 1)])}, upstream={"max_requests": 1})
    gateway = await gateway_factory()
    started = asyncio.Event()

    async def held() -> int:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(f"{gateway.url}/v1/chat/completions", json=body) as response:
            await response.content.readline()
            started.set()
            await response.read()
            return response.status

    first = asyncio.create_task(held())
    try:
        await asyncio.wait_for(started.wait(), 20)
        status, headers, body = await _post(http, gateway.url)
    finally:
        hold.set()
    assert await first == 200
    assert status == 503
    assert headers["retry-after"] == "1"
    assert body["error"]["code"] == "overloaded"


async def test_a_retry_the_budget_refused_says_so_not_overloaded(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    good = await backends("good", models=["m"])
    async with FaultyServer(Fault.RESET) as bad:
        # A budget of one retry at a time: a burst that half lands on the resetting pod
        # needs more, and Envoy flags each refused retry UO beside the reset (UR).
        config_file.write(
            {"p": (["m"], [(good, 1), (bad, 1)])},
            balancing="round_robin",
            upstream={"retry_budget_percent": 0.1, "min_retry_concurrency": 1},
        )
        gateway = await gateway_factory()
        answers = await asyncio.gather(*(_post(http, gateway.url) for _ in range(40)))
        stats = await gateway.envoy.get_stats(r"cluster\.p\.upstream_rq_retry_overflow$")
    codes = [body["error"]["code"] for status, _, body in answers if status != 200]
    assert stats["cluster.p.upstream_rq_retry_overflow"] >= 1
    assert codes.count("retry_budget_exhausted") == stats["cluster.p.upstream_rq_retry_overflow"]
    assert set(codes) == {"retry_budget_exhausted"}
    for status, headers, body in answers:
        if status != 200:
            assert (status, headers["retry-after"]) == (503, "1")
            assert body["error"]["type"] == "server_error"


async def test_one_resetting_pod_of_four_costs_no_request_at_32_concurrent_clients(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    """The default retry budget covers one pod of four that resets everything it gets,
    at docs/failures.md's 32 clients: every request is retried to a good pod and answered."""
    good = [await backends(f"good{i}", models=["m"], token_delay=0.002) for i in range(3)]
    async with FaultyServer(Fault.RESET) as bad:
        config_file.write(
            {"p": (["m"], [*((g, 1) for g in good), (bad, 1)])}, balancing="round_robin"
        )
        gateway = await gateway_factory()
        statuses: list[int] = []

        async def client() -> None:
            for _ in range(20):
                statuses.append((await _post(http, gateway.url))[0])

        await asyncio.gather(*(client() for _ in range(32)))
        stats = await gateway.envoy.get_stats(r"cluster\.p\.upstream_rq_retry")
    assert bad.requests >= 1
    assert statuses == [200] * 640, {s: statuses.count(s) for s in set(statuses)}
    assert stats["cluster.p.upstream_rq_retry_overflow"] == 0
