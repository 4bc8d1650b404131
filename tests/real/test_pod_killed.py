"""A real vLLM pod SIGKILLed (API server and engine core) under load through the gateway:
Envoy's retries and the server's health picture lose no request."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import aiohttp

from tests.e2e.conftest import eventually
from tests.real.conftest import real_gateway
from tests.real.traffic import served_counts
from tests.real.vllm_pods import MODEL, VllmPod

_CLIENTS = 8


async def test_a_pod_killed_under_load_loses_no_request(
    pods: list[VllmPod], tmp_path: Path
) -> None:
    victim = pods[2]
    outcomes: collections.Counter[str] = collections.Counter()
    stop = asyncio.Event()

    async def client(http: aiohttp.ClientSession, url: str) -> None:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, "ignore_eos": True}
        while not stop.is_set():
            try:
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    await response.read()
                    outcomes[str(response.status)] += 1
            except aiohttp.ClientError as error:
                outcomes[type(error).__name__] += 1

    async with (
        real_gateway(pods, tmp_path) as gateway,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
    ):
        clients = [asyncio.create_task(client(http, gateway.url)) for _ in range(_CLIENTS)]
        try:
            await eventually(lambda: outcomes["200"] >= 40, within_s=60, what="40 served")
            served_before = (await served_counts(gateway))[victim.port]
            assert served_before > 0, "the victim took no traffic before its kill"
            victim.kill()
            at_kill = sum(outcomes.values())
            await eventually(
                lambda: sum(outcomes.values()) >= at_kill + 150,
                within_s=120,
                what="150 more requests after the kill",
            )
        finally:
            stop.set()
            await asyncio.gather(*clients)
    assert set(outcomes) == {"200"}, outcomes
