"""Hostile pods against the whole server: simulated pods over real HTTP, and pods whose
pages lie (a 10^12-block KV cache, one 20 times its peers') or are giant. The liars get no
traffic (the decision's weights and health), the giant page is cut, and each is counted in
`xds_scrape_errors_total` and logged as a warning, never as an internal error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llm_sim.pod import SimulatedPod
from llm_sim.profiles import H100
from xds_server.app import XdsApplication
from xds_server.policy.state import EndpointState, Health
from xds_server.settings import ServerSettings
from xds_server.tuning import MAX_WEIGHT

HONEST_BLOCKS = f'num_gpu_blocks="{H100.kv_blocks}"'
PAGE_CAP = 1 << 20


class PageServer:
    """A metrics endpoint whose page is a simulated pod's, changed by `rewrite`; with
    `padding`, that many more bytes follow it, in chunks (no Content-Length)."""

    def __init__(
        self, source: SimulatedPod, rewrite: Callable[[str], str], *, padding: int = 0
    ) -> None:
        self.source = source
        self.rewrite = rewrite
        self.padding = padding
        self.port = 0

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        async with aiohttp.ClientSession() as http:
            async with http.get(self.source.url + "/metrics") as upstream:
                page = self.rewrite(await upstream.text())
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(page.encode())
        with contextlib.suppress(ConnectionError):
            for _ in range(self.padding // 65_536):
                await response.write(b"# padding " + b"x" * 65_526)
        return response

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[PageServer]:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.port = int(runner.addresses[0][1])
        try:
            yield self
        finally:
            await runner.cleanup()


def _blocks(blocks: int) -> Callable[[str], str]:
    def rewrite(page: str) -> str:
        assert HONEST_BLOCKS in page
        return page.replace(HONEST_BLOCKS, f'num_gpu_blocks="{blocks}"')

    return rewrite


async def _scrape_errors(admin_port: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as response:
            text = await response.text()
    return {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "xds_scrape_errors_total"
    }


async def _until(what: str, condition: Callable[[], Awaitable[bool]], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"Not within {within_s} s: {what}.")
        await asyncio.sleep(0.02)


async def test_lying_and_giant_pages_get_no_traffic_and_are_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="xds_server.metrics.scraper")
    async with contextlib.AsyncExitStack() as stack:
        honest = [
            await stack.enter_async_context(SimulatedPod(f"honest-{i}", seed=i)) for i in (1, 2)
        ]
        source = await stack.enter_async_context(SimulatedPod("source", seed=3))
        absurd = await stack.enter_async_context(
            PageServer(source, _blocks(10**12)).serving()  # 1.6e13 tokens
        )
        greedy = await stack.enter_async_context(
            PageServer(source, _blocks(20 * H100.kv_blocks)).serving()  # 20x its peers
        )
        giant = await stack.enter_async_context(
            PageServer(source, lambda page: page, padding=2 * PAGE_CAP).serving()
        )
        ports = {
            "honest-1": honest[0].port,
            "honest-2": honest[1].port,
            "absurd": absurd.port,
            "greedy": greedy.port,
            "giant": giant.port,
        }
        path = tmp_path / "config.json"
        path.write_text(
            json.dumps(
                {
                    "listener": {"address": "127.0.0.1", "port": 0},
                    "updates": {"debounce_s": 0.02},
                    "balancing": {"scrape_interval_s": 0.1, "smoothing": 1.0},
                    "pools": [
                        {
                            "name": "gpu",
                            "models": ["m"],
                            "endpoints": [
                                {"address": "127.0.0.1", "port": port} for port in ports.values()
                            ],
                        }
                    ],
                }
            )
        )
        settings = ServerSettings(config_path=path, xds_port=0, admin_port=0)
        app = await stack.enter_async_context(XdsApplication(settings))
        await app.wait_ready(within_s=30)

        by_name = {port: name for name, port in ports.items()}
        seen = 0

        def endpoints() -> dict[str, EndpointState]:
            pool = app.controller.decision.pools.get("gpu")
            return {} if pool is None else {by_name[e.port]: e for e in pool.endpoints}

        async def settled() -> bool:
            # Every decision looked at once the honest pods are in rotation: no liar has more
            # than an honest pod's weight. (Before two peers have a believed capacity, a
            # capacity is held only to the physical bounds: see test_scoring_distrust.py.)
            nonlocal seen
            now = endpoints()
            if now and all(now[n].health is Health.HEALTHY for n in ("honest-1", "honest-2")):
                seen += 1
                top = max(now[n].weight for n in ("honest-1", "honest-2"))
                for name in ("absurd", "greedy", "giant"):
                    assert now[name].health is not Health.HEALTHY or now[name].weight <= top
            return bool(now) and all(
                (e.health is Health.HEALTHY) == name.startswith("honest") for name, e in now.items()
            )

        await _until("only the honest pods in rotation", settled, within_s=30)
        got = endpoints()
        assert got["honest-1"].weight == got["honest-2"].weight == MAX_WEIGHT
        for name in ("absurd", "greedy", "giant"):
            assert (got[name].weight, got[name].health) == (1, Health.UNHEALTHY), name

        async def counted() -> bool:
            errors = await _scrape_errors(app.admin_port)
            return errors["too_large"] >= 1 and errors["implausible"] >= 2

        await _until("the bad pages counted", counted, within_s=30)
        errors = await _scrape_errors(app.admin_port)
        assert errors["internal"] == 0

        observations = app.pods.observations()
        pod = {name: observations[f"127.0.0.1:{port}"] for name, port in ports.items()}
        assert pod["giant"].metrics is None and pod["absurd"].metrics is None
        assert f"over the {PAGE_CAP}-byte cap (cut after" in (pod["giant"].last_error or "")
        assert "1.6e+13, above the bound of 4294967296 tokens" in (pod["absurd"].last_error or "")
        # The greedy pod may have been believed once, before its peers had spoken; never since
        # (the decisions above), and its later pages are refused against its peers.
        await _until(
            "the greedy pod refused against its peers",
            lambda: _refused(app, ports["greedy"]),
            within_s=30,
        )

        # Warnings naming the pod, the value and the bound; never an internal error.
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.name == "xds_server.metrics.scraper" and r.levelno == logging.WARNING
        ]
        absurd_id = f"127.0.0.1:{ports['absurd']}"
        assert any(
            m.startswith(f"Not believing the metrics page of pod {absurd_id}") for m in warnings
        )
        giant_id = f"127.0.0.1:{ports['giant']}"
        assert any(m.startswith(f"Cannot scrape pod {giant_id}") for m in warnings)
        assert not any(r.levelno >= logging.ERROR for r in caplog.records)
        assert seen >= 1


async def _refused(app: XdsApplication, port: int) -> bool:
    observation = app.pods.observations().get(f"127.0.0.1:{port}")
    error = observation.last_error if observation is not None else None
    return error is not None and "over 16 times the median (80000) of its 2 peers" in error
