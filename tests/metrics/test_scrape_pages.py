"""Pages the scraper does not take: over the size cap (cut, counted, logged once), or with
values no pod can have (not believed), and the check every page read goes through before
it is stored."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest

from tests.metrics.scraping import (
    LOGGER,
    FakeMetricsServer,
    Recorder,
    ScriptedFetcher,
    records,
    vllm_page,
    wait_until,
)
from xds_server.errors import ImplausibleMetricsError, ScrapeErrorKind
from xds_server.metrics.engines import PodMetrics
from xds_server.metrics.scraper import Scraper, ScrapeTarget
from xds_server.metrics.store import MetricsStore


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
