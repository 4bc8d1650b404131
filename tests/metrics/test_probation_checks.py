"""A pod whose page is late after it (re)started: the store keeps whether its health check
answers (its probation, policy/health.py), and the scraper asks it, against a real
simulated pod whose `/metrics` hangs."""

from __future__ import annotations

import time

from llm_sim.pod import SimulatedPod
from tests.metrics.scraping import wait_until
from xds_server.metrics.engines import PodMetrics
from xds_server.metrics.scraper import Scraper, ScrapeTarget
from xds_server.metrics.store import MetricsStore, PodObservation
from xds_server.sources.pod_metrics import signals_of

PAGE = PodMetrics(waiting=0, running=1)


def probation(store: MetricsStore, now: float = 100.0) -> float | None:
    observation = store.observation("p", now=now)
    assert observation is not None
    return observation.probation_s


def observed(store: MetricsStore) -> PodObservation:
    observation = store.observation("p", now=time.monotonic())
    assert observation is not None
    return observation


def test_a_new_pod_whose_page_is_late_and_health_answers_is_on_probation() -> None:
    store = MetricsStore()
    store.record_error("p", "timeout", now=1.0, late=True)
    assert store.awaits_page("p")
    assert probation(store) is None  # not asked yet
    assert store.record_health("p", answered=True, now=1.1) is True
    assert probation(store) == 0.0
    store.record_error("p", "timeout", now=3.0, late=True)
    assert store.record_health("p", answered=True, now=3.1) is False  # not the first
    assert probation(store) == 2.0
    # A check that does not answer suspends it; the clock runs from the first answer.
    store.record_error("p", "timeout", now=5.0, late=True)
    store.record_health("p", answered=False, now=5.1)
    assert probation(store) is None
    store.record_error("p", "timeout", now=7.0, late=True)
    store.record_health("p", answered=True, now=7.1)
    assert probation(store) == 6.0
    # Its first page ends it; later timeouts are a stale page, not a probation.
    store.record_success("p", PAGE, now=8.0)
    assert probation(store) is None and not store.awaits_page("p")
    store.record_error("p", "timeout", now=9.0, late=True)
    assert store.record_health("p", answered=True, now=9.1) is False
    assert probation(store) is None


def test_a_restart_starts_a_new_wait_and_an_answer_other_than_a_page_ends_it() -> None:
    store = MetricsStore()
    store.record_success("p", PAGE, now=1.0)
    store.record_error("p", "refused", now=2.0, down=True)
    assert not store.awaits_page("p")  # down: nothing to ask
    store.record_health("p", answered=True, now=2.1)
    assert probation(store) is None
    store.record_error("p", "timeout", now=4.0, late=True)
    assert store.awaits_page("p")
    assert store.record_health("p", answered=True, now=4.1) is True
    assert probation(store) == 0.0
    # The page answered, and was refused (or an error status): no longer on probation.
    store.record_error("p", "implausible", now=6.0)
    assert probation(store) is None
    # Down again, then back: a new probation from its new first answer.
    store.record_error("p", "refused", now=7.0, down=True)
    store.record_error("p", "timeout", now=9.0, late=True)
    assert store.record_health("p", answered=True, now=9.1) is True
    observation = store.observation("p", now=10.0)
    assert observation is not None and observation.probation_s == 0.0
    signals = signals_of(observation)
    assert signals is not None and signals.probation_s == 0.0 and not signals.down


async def test_the_scraper_asks_a_late_pods_health_check_until_its_page_comes() -> None:
    store = MetricsStore()
    updates: list[str] = []
    async with (
        SimulatedPod("v") as pod,
        Scraper(
            store, interval_s=0.05, timeout_s=0.2, max_backoff_s=0.2, on_update=updates.append
        ) as scraper,
    ):
        pod.hold_metrics(3600)
        target = ScrapeTarget(url=pod.url + "/metrics", health_url=pod.url + "/health")
        scraper.set_targets({"p": target})

        await wait_until(lambda: "p" in store and (observed(store).probation_s or 0.0) > 0.3)
        assert "p" in updates  # the controller hears of each answer
        assert observed(store).metrics is None
        pod.hold_metrics(0)
        await wait_until(lambda: observed(store).metrics is not None)
        assert observed(store).probation_s is None


async def test_a_pod_whose_page_is_late_and_health_hangs_too_is_not_on_probation() -> None:
    """A frozen process (SIGSTOP) accepts connections and answers nothing."""
    store = MetricsStore()
    async with (
        SimulatedPod("v") as pod,
        Scraper(store, interval_s=0.05, timeout_s=0.2, max_backoff_s=0.2) as scraper,
    ):
        pod.freeze()
        try:
            target = ScrapeTarget(url=pod.url + "/metrics", health_url=pod.url + "/health")
            scraper.set_targets({"p": target})
            await wait_until(lambda: "p" in store and observed(store).errors_in_a_row >= 3)
            assert store.awaits_page("p")
            assert observed(store).probation_s is None
        finally:
            pod.thaw()
