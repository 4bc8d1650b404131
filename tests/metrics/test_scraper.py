"""The scraper against real simulated pods and a misbehaving metrics server: what it reads,
each kind of failure and how it is recorded and logged, targets, intervals and timeouts
changed while it runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import aiohttp
import pytest

from llm_sim.metrics_text import Flavour
from llm_sim.pod import DEFAULT_MODEL, SimulatedPod
from tests.metrics.scraping import (
    LOGGER,
    FakeMetricsServer,
    Recorder,
    records,
    wait_until,
)
from xds_server.errors import ConfigError, ScrapeErrorKind
from xds_server.metrics.engines import PodMetrics
from xds_server.metrics.scraper import Scraper, ScraperState, ScrapeTarget
from xds_server.metrics.store import MetricsStore


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
