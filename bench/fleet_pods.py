"""The fleet benchmark's GPU-aware pods: static vLLM-like metrics pages that the harness
switches, served from one aiohttp application in the harness's own process.

The server cannot tell these from real pods: it scrapes each one's `/metrics` over loopback
like any vLLM server's. What a pod says is one of two fixed pages, idle or busy
(`PodLoad`), so that a switch changes its EDS weight by a known, large step (a long queue
and a full KV cache against none), and nothing else on the page ever changes: between two
switches the server has nothing new to push. Each page is padded to the size of a real
vLLM page (~61 KB; `bench.scrape_cost.synthetic_page`), because what a scrape
costs the server depends on it.

The moment that matters for push latency is when the server *read* a switched page: the
pod records the first time it served a page of the current switch (`wait_served`), and the
latency is counted from there. One `web.TCPSite` per pod, each on its own port of
127.0.0.1; a request's local port says which pod it is for. Rendering nothing per request
(the bodies are bytes built once) keeps the harness light: it serves hundreds of scrapes a
second on the same two cores as the server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web

from bench.scrape_cost import synthetic_page
from llm_sim.metrics_text import restrict_page

__all__ = ["BUSY", "FakePods", "IDLE", "PodLoad", "render_page"]


@dataclass(frozen=True, kw_only=True)
class PodLoad:
    """What a pod's page says: requests queued and running, and KV-cache use (0..1)."""

    waiting: int
    running: int
    kv_usage: float


IDLE = PodLoad(waiting=0, running=2, kv_usage=0.1)
# A queue of 40 and a nearly full cache: the queue scorer alone cuts the weight ~1,500x.
BUSY = PodLoad(waiting=40, running=64, kv_usage=0.95)

_LABELS = 'engine="0",model_name="fleet-model"'


def render_page(load: PodLoad) -> bytes:
    """A vLLM page with `load`'s three gauges and a cache config (8,192 blocks of 16
    tokens), padded to a real page's size."""
    base = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{_LABELS}}} {float(load.running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{_LABELS}}} {float(load.waiting)}\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{_LABELS}}} {load.kv_usage}\n"
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="8192"} 1.0\n'
    )
    return synthetic_page(base).encode()


@dataclass
class _Pod:
    """One pod's page and its switch (mutable; changed by `FakePods` only)."""

    body: bytes
    # Bumped by every switch; `served` is when a page of this generation was first served.
    generation: int = 0
    served: float | None = None
    event: asyncio.Event | None = None


class FakePods:
    """`count` pods serving `/metrics` on 127.0.0.1, all IDLE at first.

    Use `async with`; `ports[i]` is pod i's port once entered. Mutable state: each pod's
    `_Pod` and `pages_served` (every page served, for a sanity check).
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self._bodies = {IDLE: render_page(IDLE), BUSY: render_page(BUSY)}
        # Pages restricted to the series asked for (`?name[]=`, as prometheus-client, which
        # vLLM serves /metrics with, answers), by page and names.
        self._restricted: dict[tuple[bytes, tuple[str, ...]], bytes] = {}
        self._pods = [_Pod(body=self._bodies[IDLE]) for _ in range(count)]
        self._by_port: dict[int, _Pod] = {}
        self._runner: web.AppRunner | None = None
        self.ports: tuple[int, ...] = ()
        self.pages_served = 0

    async def __aenter__(self) -> FakePods:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        try:
            ports = []
            for pod in self._pods:
                site = web.TCPSite(self._runner, "127.0.0.1", 0)
                await site.start()
                port = int(self._runner.addresses[-1][1])
                self._by_port[port] = pod
                ports.append(port)
            self.ports = tuple(ports)
        except BaseException:
            await self._runner.cleanup()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        transport = request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        pod = self._by_port.get(int(sockname[1])) if sockname else None
        if pod is None:
            raise web.HTTPNotFound()
        self.pages_served += 1
        if pod.served is None:
            pod.served = time.monotonic()
            if pod.event is not None:
                pod.event.set()
        names = tuple(sorted(request.query.getall("name[]", [])))
        body = pod.body
        if names:
            key = (pod.body, names)
            if key not in self._restricted:
                self._restricted[key] = restrict_page(pod.body.decode(), names).encode()
            body = self._restricted[key]
        return web.Response(body=body, content_type="text/plain")

    def switch(self, index: int, load: PodLoad) -> None:
        """Make pod `index` serve `load`'s page from now on."""
        pod = self._pods[index]
        pod.body = self._bodies[load] if load in self._bodies else render_page(load)
        pod.generation += 1
        pod.served = None
        pod.event = asyncio.Event()

    async def wait_served(self, index: int, *, deadline: float) -> float | None:
        """The monotonic time pod `index` first served its page since the last `switch`,
        waiting until `deadline` (monotonic); None if it was not served by then."""
        pod = self._pods[index]
        if pod.served is None and pod.event is not None:
            try:
                await asyncio.wait_for(pod.event.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return None
        return pod.served
