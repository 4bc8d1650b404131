"""Model server doubles for the session-key tests through a real Envoy
(test_session_spill.py, test_key_homes.py): a vLLM-style page with a settable queue and
batch, optionally prefix-cache and request counters, and a chat endpoint that says which
pod answered and can be held."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.e2e.conftest import eventually
from xds_server.app import XdsApplication
from xds_server.config import RoutingConfig
from xds_server.settings import ServerSettings
from xds_testbed.gateway import LocalGateway, run_local_gateway

__all__ = [
    "POD_HEADER",
    "Pod",
    "homes_on_every_pod",
    "served",
    "session_config",
    "session_gateway",
]

POD_HEADER = "x-test-pod"

_PAGE = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} {waiting}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {running}
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{model_name="m"}} 0.2
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",num_gpu_blocks="5000"}} 1
"""

_COUNTERS = """\
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{model_name="m"}} {queries}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{model_name="m"}} {hits}
# TYPE vllm:request_success_total counter
vllm:request_success_total{{finished_reason="stop",model_name="m"}} {finished}
"""

# Requests a pod with counters finishes between two scrapes, and each one's uncached tokens.
_FINISHED_PER_SCRAPE = 2
_UNCACHED_TOKENS = 300


class Pod:
    """`waiting` and `running` as set; with `saved` set, counters that grow at every scrape
    by requests finished and `saved` cached prompt tokens for each. Chat requests count in
    `arrived`, and wait while `released` is clear."""

    def __init__(self, *, running: int = 1, saved: int | None = None) -> None:
        self.waiting, self.running, self.port = 0, running, 0
        self.saved = saved
        self.finished = self.hits = self.queries = 0
        self.arrived = 0
        self.released = asyncio.Event()
        self.released.set()

    def _page(self) -> str:
        page = _PAGE.format(waiting=self.waiting, running=self.running)
        if self.saved is None:
            return page
        self.finished += _FINISHED_PER_SCRAPE
        self.hits += _FINISHED_PER_SCRAPE * self.saved
        self.queries += _FINISHED_PER_SCRAPE * (self.saved + _UNCACHED_TOKENS)
        return page + _COUNTERS.format(queries=self.queries, hits=self.hits, finished=self.finished)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self._page(), content_type="text/plain")

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrived += 1
        await self.released.wait()
        body = {"object": "chat.completion", "choices": [], "model": "m"}
        return web.json_response(body, headers={POD_HEADER: str(self.port)})

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Pod]:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.port = int(runner.addresses[0][1])
        try:
            yield self
        finally:
            await runner.cleanup()


def session_config(pods: list[Pod], **balancing: Any) -> RoutingConfig:
    """One pool "gpu" of `pods` with session affinity and a batch limit of 16, scraped every
    0.1 s, unsmoothed; `balancing` adds to its balancing settings."""
    return RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "updates": {"debounce_s": 0.02},
            "balancing": {"scrape_interval_s": 0.1, "smoothing": 1.0, **balancing},
            "pools": [
                {
                    "name": "gpu",
                    "models": ["m"],
                    "session_affinity": True,
                    "batch_limit": 16,
                    "endpoints": [{"address": "127.0.0.1", "port": p.port} for p in pods],
                }
            ],
        }
    )


async def served(http: aiohttp.ClientSession, url: str, user: str) -> int:
    """The port of the pod that answered a chat request keyed by `user`."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": user}
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return int(response.headers[POD_HEADER])


async def session_gateway(
    stack: contextlib.AsyncExitStack, pods: list[Pod], tmp_path: Path, **balancing: Any
) -> tuple[LocalGateway, aiohttp.ClientSession]:
    """A local gateway (server and real Envoy) on `session_config(pods, **balancing)`, and
    a client session, both closed with `stack`."""
    path = tmp_path / "config.yaml"
    path.write_text(session_config(pods, **balancing).model_dump_json())
    gateway = await stack.enter_async_context(run_local_gateway(path, config_poll_s=3600))
    http = await stack.enter_async_context(aiohttp.ClientSession())
    return gateway, http


async def homes_on_every_pod(
    http: aiohttp.ClientSession, url: str, *, keys: int, pods: int
) -> dict[str, int]:
    """Where each of `keys` keys ("user-0", ...) lives, once every one of the `pods` pods
    is home to some (all of them in rotation) and every key is served where it was the
    time before: with key buckets, a new key's requests go by fewest in flight until its
    bucket is pinned."""

    async def homes() -> dict[str, int] | None:
        found = {f"user-{i}": await served(http, url, f"user-{i}") for i in range(keys)}
        again = {f"user-{i}": await served(http, url, f"user-{i}") for i in range(keys)}
        return found if found == again and len(set(found.values())) == pods else None

    found: dict[str, int] = await eventually(homes, within_s=20, what="keys on every pod")
    return found


async def peered_leader(
    stack: contextlib.AsyncExitStack, gateway: LocalGateway, tmp_path: Path
) -> XdsApplication:
    """A second replica of the gateway's config, "other" (its name sorts first: it places
    keys for both), with no Envoy of its own, peered with the gateway's server both ways;
    closed with `stack`."""
    other = await stack.enter_async_context(
        XdsApplication(
            ServerSettings(
                config_path=tmp_path / "config.yaml",
                xds_port=0,
                admin_port=0,
                config_poll_s=3600,
                replica="other",
            )
        )
    )
    await other.wait_ready(within_s=20)
    gateway.app.peers.set_peers([f"127.0.0.1:{other.xds_port}"])
    other.peers.set_peers([f"127.0.0.1:{gateway.app.xds_port}"])
    return other
