"""Keyed traffic stays load-aware, through a real Envoy: a session key sticks to its pod
while that pod is healthy and does not queue; when it queues, new requests of its keys go
to the other pods (balanced by the pool's weights through the spill listener, or with
`spill_to: ring` each key to the next pod of its Maglev permutation), stay off while its
batch is still full, and come back once it has room. Keys of other pods never move."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.e2e.conftest import eventually
from xds_server.app import XdsApplication
from xds_server.config import RoutingConfig
from xds_server.envoy import names, render_bootstrap
from xds_server.settings import ServerSettings
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.gateway import run_local_gateway

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


class Pod:
    """A model server double: a vLLM-style /metrics page with a settable queue and batch,
    and a chat endpoint that says which pod answered."""

    def __init__(self) -> None:
        self.waiting = 0
        self.running = 1
        self.port = 0

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            text=_PAGE.format(waiting=self.waiting, running=self.running), content_type="text/plain"
        )

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
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


def _config(pods: list[Pod], spill_to: str) -> RoutingConfig:
    return RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "updates": {"debounce_s": 0.02},
            "balancing": {"scrape_interval_s": 0.1, "smoothing": 1.0, "spill_to": spill_to},
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


async def _served(http: aiohttp.ClientSession, url: str, user: str) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": user}
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return int(response.headers[POD_HEADER])


@pytest.mark.parametrize("spill_to", ["pool", "ring"])
async def test_a_queueing_pods_keys_spill_and_return_and_other_keys_stay(
    tmp_path: Path, spill_to: str
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(Pod().serving()) for _ in range(3)]
        config = _config(pods, spill_to)
        path = tmp_path / "config.yaml"
        path.write_text(config.model_dump_json())
        gateway = await stack.enter_async_context(run_local_gateway(path, config_poll_s=3600))
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def served(user: str) -> int:
            return await _served(http, gateway.url, user)

        # Where each of 60 keys lives while no pod queues (all three pods in rotation).
        async def homes() -> dict[str, int] | None:
            found = {f"user-{i}": await served(f"user-{i}") for i in range(60)}
            return found if len(set(found.values())) == 3 else None

        home = await eventually(homes, within_s=20, what="keys on all three pods")
        hot, cold = pods[0].port, pods[1].port
        hot_keys = [k for k, p in home.items() if p == hot]
        cold_keys = [k for k, p in home.items() if p == cold]
        assert hot_keys and cold_keys
        # Sticky: asked again, every key answers from the same pod.
        assert {k: await served(k) for k in home} == home

        # The hot pod's batch is full and it queues: its keys spill to the next pods on the
        # ring, and no other key moves.
        pods[0].running, pods[0].waiting = 16, 8

        async def spilled() -> bool:
            return all([await served(k) != hot for k in hot_keys])

        await eventually(spilled, within_s=20, what="the hot pod's keys to spill")
        for key in cold_keys:
            assert await served(key) == cold, key
        for key in (k for k, p in home.items() if p not in (hot, cold)):
            assert await served(key) == home[key], key
        # Where one spilled key goes: with "pool", round the other pods by their (equal)
        # weights; with "ring", always the one next pod of its permutation.
        where = {await served(hot_keys[0]) for _ in range(8)}
        others = {p.port for p in pods[1:]}
        if spill_to == "pool":
            assert where == others
        else:
            assert len(where) == 1 and where < others

        # Its queue drains, its batch still full: the keys stay off (back now, they would
        # queue at once), for ten scrape intervals and more.
        pods[0].waiting = 0
        loop = asyncio.get_running_loop()
        until = loop.time() + 10 * config.balancing.scrape_interval_s
        while loop.time() < until:
            pool = gateway.app.controller.decision.pools["gpu"]
            assert next(e.spilling for e in pool.endpoints if e.port == hot)
            for key in hot_keys:
                assert await served(key) != hot, key

        # It has room again: its keys come back (their cached prefixes are there).
        pods[0].running = 2

        async def returned() -> bool:
            return all([await served(k) == hot for k in hot_keys])

        await eventually(returned, within_s=20, what="the hot pod's keys to come back")
        assert {k: await served(k) for k in home} == home


async def test_an_envoy_without_the_internal_listener_extension_gets_spills_to_the_ring(
    tmp_path: Path,
) -> None:
    """An Envoy whose bootstrap lacks `envoy.bootstrap.internal_listener` refuses the spill
    listener (a NACK, counted, naming it). Its spilled keys would fail to connect there, so
    the server falls back to `spill_to: ring` for every Envoy (logged, exported): a
    spilling pod's keys are then served by the next pod of their ring, none refused."""
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(Pod().serving()) for _ in range(3)]
        path = tmp_path / "config.yaml"
        path.write_text(_config(pods, "pool").model_dump_json())
        settings = ServerSettings(config_path=path, xds_port=0, admin_port=0, config_poll_s=3600)
        app = await stack.enter_async_context(XdsApplication(settings))
        await app.wait_ready(within_s=20)
        registry = app.telemetry.registry
        assert registry.get_sample_value("xds_spill_to_ring_fallback") == 0
        bootstrap = render_bootstrap(
            xds_address="127.0.0.1", xds_port=app.xds_port, node_id="old-bootstrap",
            node_cluster="e2e", admin_port=0,
        )  # fmt: skip
        del bootstrap["bootstrap_extensions"]
        envoy = await stack.enter_async_context(EnvoyProcess(bootstrap))
        await envoy.wait_live(timeout=20)
        url = f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}"
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await eventually(
            lambda: registry.get_sample_value("xds_spill_to_ring_fallback") == 1,
            within_s=20,
            what="the fall back to the ring after the spill listener's NACK",
        )
        assert registry.get_sample_value("xds_nacks_total", {"type": "lds"})
        assert app.controller.spill_fallback is not None
        assert names.spill_listener_name("gpu") in app.controller.spill_fallback
        listeners = await envoy.admin_get("/listeners")
        assert names.LISTENER_NAME in listeners
        assert names.spill_listener_name("gpu") not in listeners

        async def served(user: str) -> int:
            return await _served(http, url, user)

        async def homes() -> dict[str, int] | None:
            found = {f"user-{i}": await served(f"user-{i}") for i in range(60)}
            return found if len(set(found.values())) == 3 else None

        home = await eventually(homes, within_s=20, what="keys on all three pods")
        hot = pods[0].port
        hot_keys = [k for k, p in home.items() if p == hot]
        assert hot_keys
        pods[0].running, pods[0].waiting = 16, 8

        async def spilled() -> bool:
            return all([await served(k) != hot for k in hot_keys])

        # Every request answered 200 (`_served` asserts it), each spilled key by one pod.
        await eventually(spilled, within_s=20, what="the hot pod's keys to spill")
        for key in hot_keys:
            assert len({await served(key) for _ in range(4)}) == 1, key
        for key in (k for k, p in home.items() if p != hot):
            assert await served(key) == home[key], key
