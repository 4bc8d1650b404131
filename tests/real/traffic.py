"""What the real-vLLM tests send and read back: which pod served a request (Envoy's own
per-host request counters: a real vLLM names no pod in its answers), and load put straight
on one pod so its queue grows."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from tests.e2e.conftest import eventually
from tests.real.vllm_pods import MAX_NUM_SEQS, MODEL, VllmPod
from xds_server.metrics.engines import engine_adapter
from xds_server.metrics.exposition import parse_samples
from xds_testbed.gateway import LocalGateway

__all__ = [
    "complete",
    "loaded",
    "loaded_lora_page",
    "served_counts",
    "served_one",
    "streamed",
]

_SMALL = "vllm:request_params_max_tokens_bucket"


async def served_counts(gateway: LocalGateway, pool: str = "gpu") -> dict[int, int]:
    """Envoy's `rq_total` per host over the clusters of `pool` (the pool's own, and its
    session, long-prompt and band clusters, `<pool>/...`): port -> requests sent to it."""
    text = await gateway.envoy.admin_get("/clusters")
    counts: dict[int, int] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) != 4 or parts[2] != "rq_total":
            continue
        if parts[0] == pool or parts[0].startswith(pool + "/"):
            port = int(parts[1].rsplit(":", 1)[1])
            counts[port] = counts.get(port, 0) + int(parts[3])
    return counts


async def complete(
    http: aiohttp.ClientSession, url: str, body: Mapping[str, Any]
) -> Mapping[str, Any]:
    """POST a completion (`/v1/completions`) and return its JSON; fails on a non-200."""
    request = {"model": MODEL, "prompt": "hello there", "max_tokens": 2, **body}
    async with http.post(f"{url}/v1/completions", json=request) as response:
        text = await response.text()
        assert response.status == 200, (response.status, text)
        return await response.json(content_type=None)  # type: ignore[no-any-return]


async def _small_requests(http: aiohttp.ClientSession, pod: VllmPod) -> float:
    """Requests `pod` finished with max_tokens <= 2 (its own histogram): what `served_one`
    sends, never the long requests `loaded` puts on a pod."""
    async with http.get(pod.url + "/metrics") as response:
        text = await response.text()
    return sum(
        sample.value for sample in parse_samples(text, {_SMALL}) if sample.labels.get("le") == "2.0"
    )


async def served_one(
    gateway: LocalGateway,
    http: aiohttp.ClientSession,
    pods: list[VllmPod],
    body: Mapping[str, Any],
) -> int:
    """Send one 2-token completion through the gateway, alone; the port of the pod that
    served it, by the pods' own counts (Envoy's per-host counters restart when a cluster
    is rebuilt)."""
    before = {pod.port: await _small_requests(http, pod) for pod in pods}
    await complete(http, gateway.url, {**body, "max_tokens": 2})

    async def grown() -> list[int]:
        return [pod.port for pod in pods if await _small_requests(http, pod) > before[pod.port]]

    grew: list[int] = await eventually(grown, within_s=10, what="the serving pod's count")
    assert len(grew) == 1, grew
    return grew[0]


@contextlib.asynccontextmanager
async def loaded(pod: VllmPod, *, in_flight: int = 16) -> AsyncIterator[None]:
    """Keep `in_flight` long completions running on `pod`, sent to it directly (not
    through the gateway): 4 run and the rest wait in its queue, until the block ends."""
    stop = asyncio.Event()

    async def worker(http: aiohttp.ClientSession) -> None:
        body = {"max_tokens": 200, "ignore_eos": True}
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError):
                await complete(http, pod.url, body)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        tasks = [asyncio.create_task(worker(http)) for _ in range(in_flight)]
        try:
            yield
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def streamed(
    http: aiohttp.ClientSession, pod: VllmPod, path: str, body: Mapping[str, Any]
) -> bytes:
    """The raw SSE body of a 4-token stream from `pod` at `path`, usage included."""
    request = {
        "model": MODEL,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    async with http.post(pod.url + path, json=request) as response:
        assert response.status == 200, await response.text()
        return await response.read()


async def loaded_lora_page(http: aiohttp.ClientSession, pod: VllmPod) -> str:
    """`pod`'s page while adapter `a` runs and requests wait (twice its batch sent)."""
    body = {"model": "a", "max_tokens": 200, "ignore_eos": True}
    load = [asyncio.create_task(complete(http, pod.url, body)) for _ in range(MAX_NUM_SEQS * 2)]
    try:
        while True:
            async with http.get(pod.url + "/metrics") as response:
                page = await response.text()
            metrics = engine_adapter("vllm").parse(page)
            if metrics.running and metrics.waiting and metrics.lora_running:
                return page
            await asyncio.sleep(0.05)
    finally:
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
