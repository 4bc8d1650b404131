"""When the scraper scrapes: on a grid of the interval, backing off from a failing pod,
and less often from a quiet one."""

from __future__ import annotations

import asyncio

import pytest

from llm_sim.pod import SimulatedPod
from tests.metrics.scraping import (
    FakeMetricsServer,
    Recorder,
    ScriptedFetcher,
    vllm_page,
    wait_until,
)
from xds_server.errors import ScrapeError, ScrapeErrorKind
from xds_server.metrics.scraper import Scraper, ScrapeTarget
from xds_server.metrics.store import ErrorStreak, MetricsStore


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
