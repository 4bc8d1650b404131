"""The scraper against real simulated pods and a misbehaving metrics server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from llm_sim.metrics_text import Flavour
from llm_sim.pod import DEFAULT_MODEL, SimulatedPod
from xds_server.errors import ConfigError, ImplausibleMetricsError, ScrapeError, ScrapeErrorKind
from xds_server.metrics.engines import PodMetrics
from xds_server.metrics.fetching import PageFetcher
from xds_server.metrics.scraper import Scraper, ScraperState, ScrapeTarget
from xds_server.metrics.store import ErrorStreak, MetricsStore

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


@pytest.fixture
async def server() -> AsyncIterator[FakeMetricsServer]:
    fake = FakeMetricsServer()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


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


async def test_scrapes_simulated_pods_of_several_engines() -> None:
    recorder = Recorder()
    store = MetricsStore()
    async with (
        SimulatedPod("v", adapters=("sql-lora",)) as vllm,
        SimulatedPod("t", flavour=Flavour.TRITON) as triton,
        SimulatedPod("s", flavour=Flavour.SGLANG) as sglang,
        Scraper(store, interval_s=0.02, seed=1, **recorder.kwargs()) as scraper,
    ):
        scraper.set_targets(
            {
                "v": ScrapeTarget(url=vllm.url + "/metrics"),
                "t": ScrapeTarget(url=triton.url + "/metrics", engine="triton"),
                "s": ScrapeTarget(url=sglang.url + "/metrics", engine="sglang"),
            }
        )
        await wait_until(lambda: {"v", "t", "s"} <= set(recorder.updates))
        idle = store.snapshot(time.monotonic())
        assert {pod: obs.metrics.running for pod, obs in idle.items() if obs.metrics} == {
            "v": 0,
            "t": 0,
            "s": 0,
        }
        assert idle["v"].metrics is not None and idle["v"].metrics.kv_capacity_tokens == 80_000
        # Load the vLLM pod with a LoRA request: the next scrapes see it.
        async with aiohttp.ClientSession() as client:
            request = asyncio.create_task(
                client.post(
                    vllm.url + "/v1/completions",
                    json={"model": "sql-lora", "prompt": "a b c", "max_tokens": 2000},
                )
            )

            def busy() -> bool:
                observation = store.observation("v", now=time.monotonic())
                return (
                    observation is not None
                    and observation.metrics is not None
                    and (observation.metrics.running == 1)
                )

            await wait_until(busy)
            observation = store.observation("v", now=time.monotonic())
            assert observation is not None and observation.metrics is not None
            assert observation.metrics.lora_running == ("sql-lora",)
            assert observation.metrics.max_lora is not None
            assert observation.errors_in_a_row == 0 and observation.age_s is not None
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
    assert scraper.state is ScraperState.CLOSED
    assert recorder.errors == []
    assert all(duration > 0 for _, duration in recorder.durations)
    assert len(recorder.durations) == len(recorder.updates)


async def test_failures_are_recorded_and_logged_once_per_streak(
    server: FakeMetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    recorder = Recorder()
    store = MetricsStore()
    target = ScrapeTarget(url=server.url)
    async with Scraper(
        store, interval_s=0.01, max_backoff_s=0.02, seed=2, **recorder.kwargs()
    ) as scraper:
        scraper.set_targets({"pod-a": target})
        server.waiting = 7
        await wait_until(lambda: len(recorder.updates) >= 2)
        server.mode = "500"
        await wait_until(lambda: len(recorder.errors) >= 4)
        observation = store.snapshot(time.monotonic())["pod-a"]
        assert observation.metrics is not None and observation.metrics.waiting == 7
        assert observation.errors_in_a_row >= 4
        assert observation.last_error == "HTTP 500 Internal Server Error"
        assert {kind for _, kind in recorder.errors} == {ScrapeErrorKind.HTTP_STATUS}

        warnings = records(caplog, logging.WARNING)
        assert len(warnings) == 1
        message = warnings[0].getMessage()
        assert message.startswith(f"Cannot scrape pod pod-a ({server.url}): HTTP 500")
        assert "last good metrics stay in use until they go stale" in message
        assert len(records(caplog, logging.DEBUG)) >= 3

        server.waiting = 1
        server.mode = "ok"
        await wait_until(lambda: store.snapshot(time.monotonic())["pod-a"].errors_in_a_row == 0)
        recovered = store.snapshot(time.monotonic())["pod-a"]
        assert recovered.metrics is not None and recovered.metrics.waiting == 1
        infos = records(caplog, logging.INFO)
        assert len(infos) == 1
        assert infos[0].getMessage().startswith("Scraping pod pod-a (")
        assert "works again after" in infos[0].getMessage()

        # A new streak, of another kind: logged again, once.
        server.mode = "partial"
        errors_before = len(recorder.errors)
        await wait_until(lambda: len(recorder.errors) >= errors_before + 3)
        warnings = records(caplog, logging.WARNING)
        assert len(warnings) == 2
        assert "the page has no vllm:num_requests_waiting" in warnings[1].getMessage()
        assert recorder.errors[-1][1] is ScrapeErrorKind.PARSE
        assert len(server.peers) == 1  # one keep-alive connection throughout


@pytest.mark.parametrize(
    ("mode", "kind", "message"),
    [
        ("hang", ScrapeErrorKind.TIMEOUT, "no complete page within 0.2 s"),
        ("malformed", ScrapeErrorKind.PARSE, "line 4: vllm:num_requests_waiting: value is not"),
        (
            "huge",
            ScrapeErrorKind.TOO_LARGE,
            "150192 bytes (Content-Length), over the 100000-byte cap",
        ),
        ("huge_chunked", ScrapeErrorKind.TOO_LARGE, "over the 100000-byte cap (cut after"),
        ("lying", ScrapeErrorKind.IMPLAUSIBLE, "is 1.6e+13, above the bound of 4294967296 tokens"),
    ],
)
async def test_each_kind_of_failure(
    server: FakeMetricsServer, mode: str, kind: ScrapeErrorKind, message: str
) -> None:
    recorder = Recorder()
    store = MetricsStore()
    server.mode = mode
    async with (
        SimulatedPod("healthy") as healthy,
        Scraper(
            store, interval_s=0.02, timeout_s=0.2, max_page_bytes=100_000, **recorder.kwargs()
        ) as scraper,
    ):
        scraper.set_targets(
            {"bad": ScrapeTarget(url=server.url), "ok": ScrapeTarget(url=healthy.url + "/metrics")}
        )
        await wait_until(lambda: len(recorder.errors) >= 1)
        assert recorder.errors[0] == ("bad", kind)
        last_error = store.snapshot(time.monotonic())["bad"].last_error
        assert last_error is not None and message in last_error
        if mode == "hang":  # a hanging pod held up nobody else meanwhile
            assert recorder.updates.count("ok") >= 3
        await wait_until(lambda: recorder.updates.count("ok") >= 3)
        assert {pod for pod, _ in recorder.errors} == {"bad"}


async def test_unreachable_and_non_http_pods() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]

    async def junk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"\x00\x01 this is not HTTP\r\n\r\n")
        await writer.drain()
        writer.close()

    junk_server = await asyncio.start_server(junk, "127.0.0.1", 0)
    junk_port = junk_server.sockets[0].getsockname()[1]
    recorder = Recorder()
    store = MetricsStore()
    try:
        async with Scraper(store, interval_s=0.02, **recorder.kwargs()) as scraper:
            scraper.set_targets(
                {
                    "refused": ScrapeTarget(url=f"http://127.0.0.1:{closed_port}/metrics"),
                    "junk": ScrapeTarget(url=f"http://127.0.0.1:{junk_port}/metrics"),
                }
            )
            await wait_until(lambda: {pod for pod, _ in recorder.errors} == {"refused", "junk"})
    finally:
        junk_server.close()
        await junk_server.wait_closed()
    kinds = dict(recorder.errors)
    assert kinds["refused"] is ScrapeErrorKind.CONNECT
    assert kinds["junk"] is ScrapeErrorKind.BODY
    junk_error = store.snapshot(time.monotonic())["junk"].last_error
    assert junk_error is not None and junk_error.startswith("not a valid HTTP response: ")
    refused_error = store.snapshot(time.monotonic())["refused"].last_error
    assert refused_error is not None and refused_error.startswith(
        f"cannot connect to 127.0.0.1:{closed_port}: "
    )
    # A pod that refuses connections is down: the policy hears of it at once (an update),
    # while one that answers something else keeps its last metrics until they are stale.
    assert set(recorder.updates) == {"refused"}
    snapshot = store.snapshot(time.monotonic())
    assert snapshot["refused"].down and not snapshot["junk"].down


async def test_targets_change_while_running(server: FakeMetricsServer) -> None:
    recorder = Recorder()
    store = MetricsStore()
    scraper = Scraper(store, interval_s=0.01, **recorder.kwargs())
    scraper.set_targets({"a": ScrapeTarget(url=server.url)})  # before opening: kept
    async with scraper:
        await wait_until(lambda: "a" in store)
        scraper.set_targets({"b": ScrapeTarget(url=server.url)})
        assert "a" not in store  # forgotten at once
        await wait_until(lambda: "b" in store)
        assert set(scraper.targets) == {"b"}
        updates = len(recorder.updates)
        await wait_until(lambda: len(recorder.updates) >= updates + 3)
        assert "a" not in store and "a" not in recorder.updates[updates:]
        # A changed target starts afresh (its store entry too); an unchanged one goes on.
        store.record_error("b", "marker", now=time.monotonic())
        scraper.set_targets({"b": ScrapeTarget(url=server.url)})
        assert store.snapshot(time.monotonic())["b"].last_error == "marker"
        scraper.set_targets({"b": ScrapeTarget(url=server.url, engine="sglang")})
        assert "b" not in store
        await wait_until(lambda: "b" in store)
        assert store.snapshot(time.monotonic())["b"].last_error is not None  # sglang names
        scraper.set_targets({})
        assert len(store) == 0
    await scraper.aclose()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        scraper.set_targets({})
    with pytest.raises(RuntimeError, match="opened only once"):
        async with scraper:
            pass


async def test_iterations_bound_the_loops_and_starts_are_jittered(
    server: FakeMetricsServer,
) -> None:
    recorder = Recorder()
    seen: list[float] = []
    store = MetricsStore()
    start = time.monotonic()
    async with Scraper(
        store,
        interval_s=0.3,
        seed=3,
        on_update=lambda pod: seen.append(time.monotonic() - start),
        _iterations=1,
    ) as scraper:
        scraper.set_targets({f"pod-{i}": ScrapeTarget(url=server.url) for i in range(12)})
        await scraper.join()
    assert len(seen) == 12 and len(store) == 12
    assert max(seen) < 0.3 + 0.25
    assert max(seen) - min(seen) > 0.1  # spread over the interval, not in lockstep
    del recorder


async def test_a_raising_callback_is_logged_once_and_scraping_goes_on(
    server: FakeMetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []

    def broken(pod_id: str) -> None:
        calls.append(pod_id)
        raise ValueError("controller bug")

    async with Scraper(MetricsStore(), interval_s=0.01, on_update=broken) as scraper:
        scraper.set_targets({"p": ScrapeTarget(url=server.url)})
        await wait_until(lambda: len(calls) >= 3)
    errors = records(caplog, logging.ERROR)
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert "on_update callback raised for pod p" in errors[0].getMessage()


async def test_a_bug_in_reading_is_an_internal_error_with_its_traceback(
    server: FakeMetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    class BrokenAdapter:
        def parse(self, text: str) -> PodMetrics:
            raise KeyError("oops")

    target = ScrapeTarget(url=server.url)
    object.__setattr__(target, "adapter", BrokenAdapter())
    recorder = Recorder()
    async with Scraper(MetricsStore(), interval_s=0.01, **recorder.kwargs()) as scraper:
        scraper.set_targets({"p": target})
        await wait_until(lambda: len(recorder.errors) >= 2)
    assert recorder.errors[0] == ("p", ScrapeErrorKind.INTERNAL)
    errors = records(caplog, logging.ERROR)
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert "KeyError: 'oops'" in errors[0].getMessage()


def test_the_schedule_keeps_a_grid_and_backs_off() -> None:
    scraper = Scraper(MetricsStore(), interval_s=0.1, max_backoff_s=1.0, seed=4)
    assert scraper._schedule(5.0, 5.03, None) == pytest.approx(5.1)
    # Late by more than two intervals: the missed slots are skipped, the phase kept.
    assert scraper._schedule(5.0, 5.25, None) == pytest.approx(5.3)
    assert scraper._schedule(5.0, 5.2, None) == pytest.approx(5.3)

    def streak(count: int) -> ErrorStreak:
        return ErrorStreak(count=count, first_at=0.0, first_error="e", last_error="e")

    for count, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (60, 1.0)]:
        delay = scraper._schedule(5.0, 6.0, streak(count)) - 6.0
        assert base * 0.9 <= delay <= base * 1.1, count
    # A backoff never undercuts the interval.
    slow = Scraper(MetricsStore(), interval_s=5.0, max_backoff_s=1.0, seed=4)
    assert 4.5 <= slow._schedule(0.0, 1.0, streak(3)) - 1.0 <= 5.5


def test_a_quiet_pod_is_scraped_at_the_quiet_interval() -> None:
    scraper = Scraper(MetricsStore(), interval_s=0.1, quiet_interval_s=0.5, seed=4)
    assert scraper._schedule(5.0, 5.03, None, quiet=True) == pytest.approx(5.5)
    assert scraper._schedule(5.0, 5.03, None, quiet=False) == pytest.approx(5.1)
    # Never faster than the interval, whatever the quiet one says.
    fast = Scraper(MetricsStore(), interval_s=0.1, quiet_interval_s=0.05, seed=4)
    assert fast._schedule(5.0, 5.03, None, quiet=True) == pytest.approx(5.1)


async def test_quiet_pods_are_scraped_less_often_and_busy_ones_at_the_interval(
    server: FakeMetricsServer,
) -> None:
    """An idle pod whose page does not change costs a fifth of the scrapes; one with a
    queue is scraped at the interval, changed or not."""
    server.waiting = 3
    recorder = Recorder()
    async with (
        SimulatedPod("idle") as idle,
        Scraper(
            MetricsStore(), interval_s=0.02, quiet_interval_s=0.1, seed=1, **recorder.kwargs()
        ) as scraper,
    ):
        scraper.set_targets(
            {"busy": ScrapeTarget(url=server.url), "idle": ScrapeTarget(url=idle.url + "/metrics")}
        )
        await wait_until(lambda: recorder.updates.count("idle") >= 6, limit_s=30)
        busy, quiet = recorder.updates.count("busy"), recorder.updates.count("idle")
    assert busy >= 2 * quiet, (busy, quiet)


def test_targets_are_validated_values() -> None:
    target = ScrapeTarget(url="http://10.0.0.1:8000/metrics", engine="tgi")
    assert target == ScrapeTarget(url="http://10.0.0.1:8000/metrics", engine="tgi")
    assert hash(target) == hash(ScrapeTarget(url="http://10.0.0.1:8000/metrics", engine="tgi"))
    assert target != ScrapeTarget(url="http://10.0.0.1:8000/metrics")
    assert target.adapter.engine.value == "tgi"
    for url in ("10.0.0.1:8000/metrics", "ftp://h/metrics", "http:///metrics"):
        with pytest.raises(ConfigError, match="must be http"):
            ScrapeTarget(url=url)
    with pytest.raises(ConfigError, match="Unknown engine"):
        ScrapeTarget(url="http://h/metrics", engine="nope")
    with pytest.raises(ValueError, match="interval_s must be positive"):
        Scraper(MetricsStore(), interval_s=0)
    scraper = Scraper(MetricsStore())
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        scraper.timeout_s = -1
    assert DEFAULT_MODEL  # the simulated pods' model, used above through adapters


async def test_interval_and_timeout_can_change_while_open(server: FakeMetricsServer) -> None:
    recorder = Recorder()
    async with Scraper(
        MetricsStore(), interval_s=0.01, timeout_s=5.0, **recorder.kwargs()
    ) as scraper:
        scraper.set_targets({"p": ScrapeTarget(url=server.url)})
        await wait_until(lambda: len(recorder.updates) >= 3)
        scraper.interval_s = 0.2
        scraper.timeout_s = 0.1
        await asyncio.sleep(0.05)  # the pod's current 10 ms sleep ends; the next is 200 ms
        before = len(recorder.updates)
        await asyncio.sleep(0.3)
        assert 1 <= len(recorder.updates) - before <= 2
        server.mode = "hang"
        await wait_until(lambda: len(recorder.errors) >= 1, limit_s=1.0)
        assert recorder.errors == [("p", ScrapeErrorKind.TIMEOUT)]


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


@pytest.mark.looptime
async def test_scrapes_run_on_the_loops_clock_with_backoff_through_the_fetch_seam() -> None:
    refused = ScrapeError("connection refused", kind=ScrapeErrorKind.CONNECT)
    fetcher = ScriptedFetcher([refused, refused, vllm_page(waiting=4)])
    store = MetricsStore()
    scraper = Scraper(
        store, interval_s=0.5, max_backoff_s=4.0, fetcher=fetcher, seed=3, _iterations=4
    )
    async with scraper:
        scraper.set_targets({"p": ScrapeTarget(url="http://10.0.0.1:8000/metrics")})
        await scraper.join()
        observation = store.snapshot(asyncio.get_running_loop().time())["p"]
    assert fetcher.closed
    assert observation.metrics is not None and observation.metrics.waiting == 4
    first, second, third, fourth = fetcher.fetched_at
    # Two failures back off (0.5 s, then 1 s, each ±10%), then the grid of 0.5 s resumes.
    assert 0.45 <= second - first <= 0.55
    assert 0.9 <= third - second <= 1.1
    assert fourth - third == pytest.approx(0.5)


async def test_a_page_over_the_cap_is_cut_counted_and_logged_once_without_a_traceback(
    server: FakeMetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    recorder = Recorder()
    store = MetricsStore()
    server.mode = "huge_chunked"
    async with Scraper(
        store, interval_s=0.02, max_backoff_s=0.05, max_page_bytes=100_000, **recorder.kwargs()
    ) as scraper:
        scraper.set_targets({"p": ScrapeTarget(url=server.url)})
        await wait_until(lambda: len(recorder.errors) >= 3, limit_s=20)
    assert {kind for _, kind in recorder.errors} == {ScrapeErrorKind.TOO_LARGE}
    observation = store.snapshot(time.monotonic())["p"]
    assert observation.metrics is None and observation.last_error is not None
    cut_after = int(observation.last_error.split("cut after ")[1].split(" ")[0])
    assert 100_000 < cut_after <= 100_000 + 16_384 + 200  # stopped at the chunk past the cap
    # The rest of the body is never read: the connection is closed, not reused.
    assert len(server.peers) >= 2
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 1 and warnings[0].exc_info is None
    assert "over the 100000-byte cap" in warnings[0].getMessage()
    assert records(caplog, logging.ERROR) == []
    assert recorder.updates == []  # the policy hears nothing: the pod is not in rotation


async def test_a_page_with_values_no_pod_can_have_is_not_believed(
    server: FakeMetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    store = MetricsStore()
    server.mode = "lying"
    async with Scraper(store, interval_s=0.02, max_backoff_s=0.05, **recorder.kwargs()) as scraper:
        scraper.set_targets({"p": ScrapeTarget(url=server.url)})
        await wait_until(lambda: len(recorder.errors) >= 2, limit_s=20)
        observation = store.snapshot(time.monotonic())["p"]
        assert observation.metrics is None  # never stored: the pod has no metrics
        assert recorder.updates == []
        assert {kind for _, kind in recorder.errors} == {ScrapeErrorKind.IMPLAUSIBLE}
        warnings = records(caplog, logging.WARNING)
        assert len(warnings) == 1 and warnings[0].exc_info is None
        assert (
            warnings[0]
            .getMessage()
            .startswith(
                f"Not believing the metrics page of pod p ({server.url}): "
                "vllm:cache_config_info block_size x num_gpu_blocks (kv_capacity) is 1.6e+13, "
                "above the bound of 4294967296 tokens per pod: not believed. Its last good "
                "metrics stay in use until they go stale (none: out of rotation)"
            )
        )
        assert records(caplog, logging.ERROR) == []
        server.mode = "ok"
        await wait_until(lambda: store.snapshot(time.monotonic())["p"].metrics is not None)
        await wait_until(lambda: "p" in recorder.updates)


def _refuse_long_queues(seen: list[str]) -> Callable[[str, PodMetrics], None]:
    def check(pod_id: str, metrics: PodMetrics) -> None:
        seen.append(pod_id)
        if metrics.waiting > 5:
            raise ImplausibleMetricsError("waiting", metrics.waiting, "above 5 (the test's)")

    return check


@pytest.mark.looptime
async def test_the_check_sees_every_page_read_before_it_is_stored() -> None:
    fetcher = ScriptedFetcher([vllm_page(waiting=1), vllm_page(waiting=9), vllm_page(waiting=2)])
    store = MetricsStore()
    seen: list[str] = []
    recorder = Recorder()
    scraper = Scraper(
        store,
        interval_s=0.5,
        fetcher=fetcher,
        check=_refuse_long_queues(seen),
        seed=3,
        _iterations=3,
        **recorder.kwargs(),
    )
    async with scraper:
        scraper.set_targets({"p": ScrapeTarget(url="http://10.0.0.1:8000/metrics")})
        await scraper.join()
        observation = store.snapshot(asyncio.get_running_loop().time())["p"]
    assert seen == ["p", "p", "p"]
    assert recorder.errors == [("p", ScrapeErrorKind.IMPLAUSIBLE)]
    assert recorder.updates == ["p", "p"]
    assert observation.metrics is not None and observation.metrics.waiting == 2
    assert fetcher.max_bytes == 1 << 20  # the default cap, handed to the fetcher


async def test_the_page_cap_can_change_while_open(server: FakeMetricsServer) -> None:
    recorder = Recorder()
    server.mode = "huge"
    async with Scraper(MetricsStore(), interval_s=0.02, **recorder.kwargs()) as scraper:
        scraper.set_targets({"p": ScrapeTarget(url=server.url)})
        await wait_until(lambda: len(recorder.updates) >= 1)  # 150 KB: under 1 MiB
        scraper.max_page_bytes = 100_000
        await wait_until(lambda: len(recorder.errors) >= 1)
        assert recorder.errors[0] == ("p", ScrapeErrorKind.TOO_LARGE)
        with pytest.raises(ValueError, match="max_page_bytes must be at least 1"):
            scraper.max_page_bytes = 0
