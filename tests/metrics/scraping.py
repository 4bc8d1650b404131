"""What the scraper's tests share: a metrics server whose behaviour a test switches, a
fetcher that answers from a script at the fetch seam, and recorders of the scraper's
callbacks and log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from yarl import URL

from xds_server.errors import ScrapeError, ScrapeErrorKind
from xds_server.metrics.fetching import PageFetcher

LOGGER = "xds_server.metrics.scraper"


def vllm_page(waiting: int) -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n'
    )


class FakeMetricsServer:
    """A metrics endpoint whose behaviour the test switches (`mode`)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.waiting = 0
        self.requests = 0
        self.peers: set[object] = set()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/metrics"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if request.transport is not None:
            self.peers.add(request.transport.get_extra_info("peername"))
        if self.mode == "ok":
            return web.Response(text=vllm_page(self.waiting))
        if self.mode == "500":
            return web.Response(status=500, text="engine dead")
        if self.mode == "partial":
            return web.Response(text="# TYPE vllm:num_requests_running gauge\n")
        if self.mode == "malformed":
            return web.Response(text=vllm_page(0).replace(" 0.0", " zero"))
        if self.mode == "huge":
            return web.Response(text=vllm_page(0) + "#" * 150_000)
        if self.mode == "huge_chunked":  # no Content-Length: known to be too large only late
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            await response.write(vllm_page(0).encode())
            with contextlib.suppress(ConnectionError):
                for _ in range(64):
                    await response.write(b"#" * 16_384)
            return response
        if self.mode == "lying":  # the pod that took 763 of 767 requests
            return web.Response(
                text=vllm_page(0)
                + 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000000000000"} 1\n'
            )
        if self.mode == "hang":
            await asyncio.sleep(30)
        raise AssertionError(self.mode)


async def wait_until(condition: Callable[[], bool], limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


class Recorder:
    """The three callbacks, recorded."""

    def __init__(self) -> None:
        self.updates: list[str] = []
        self.errors: list[tuple[str, ScrapeErrorKind]] = []
        self.durations: list[tuple[str, float]] = []

    def kwargs(self) -> dict[str, Any]:
        return {
            "on_update": self.updates.append,
            "observe_error": lambda pod, kind: self.errors.append((pod, kind)),
            "observe_scrape": lambda pod, duration: self.durations.append((pod, duration)),
        }


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


class ScriptedFetcher:
    """A PageFetcher at the seam: answers each fetch with the next scripted page or error,
    and records the loop time of each."""

    def __init__(self, script: list[str | ScrapeError]) -> None:
        self.script = script
        self.fetched_at: list[float] = []
        self.max_bytes = 0
        self.closed = False

    async def fetch(self, url: URL, *, timeout_s: float, max_bytes: int) -> bytes:
        self.fetched_at.append(asyncio.get_running_loop().time())
        self.max_bytes = max_bytes
        item = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(item, ScrapeError):
            raise item
        return item.encode()

    async def aclose(self) -> None:
        self.closed = True


_fetcher: type[PageFetcher] = ScriptedFetcher
