"""MetricsStore: freshness, error streaks and the prefix-cache hit rate, on a hand-driven clock."""

from __future__ import annotations

import pytest

from xds_server.metrics.engines import PodMetrics
from xds_server.metrics.store import ErrorStreak, MetricsStore, PodObservation


def metrics(
    hits: float | None = None, queries: float | None = None, *, waiting: int = 0
) -> PodMetrics:
    return PodMetrics(
        waiting=waiting,
        running=1,
        prefix_cache_hits_tokens=hits,
        prefix_cache_queries_tokens=queries,
    )


def rate(store: MetricsStore, pod: str = "p", now: float = 0.0) -> float | None:
    observation = store.observation(pod, now=now)
    assert observation is not None
    return observation.prefix_hit_rate


def test_the_latest_metrics_and_their_age() -> None:
    store = MetricsStore()
    assert store.snapshot(0.0) == {} and store.observation("p", now=0.0) is None
    assert store.record_success("p", metrics(waiting=1), now=10.0) is None
    assert store.record_success("p", metrics(waiting=2), now=10.5) is None
    assert store.observation("p", now=12.0) == PodObservation(
        metrics=metrics(waiting=2),
        age_s=1.5,
        prefix_hit_rate=None,
        errors_in_a_row=0,
        failing_for_s=None,
        last_error=None,
    )
    assert "p" in store and len(store) == 1
    assert repr(store) == "<MetricsStore pods=1 failing=0>"


def test_an_error_streak_keeps_the_last_metrics_and_ends_with_a_success() -> None:
    store = MetricsStore()
    store.record_success("p", metrics(waiting=4), now=1.0)
    first = store.record_error("p", "connect: refused", now=2.0)
    assert first == ErrorStreak(
        count=1,
        first_at=2.0,
        first_error="connect: refused",
        last_error="connect: refused",
        last_at=2.0,
    )
    second = store.record_error("p", "timeout", now=3.0)
    assert (second.count, second.first_at, second.first_error) == (2, 2.0, "connect: refused")
    observation = store.snapshot(5.0)["p"]
    assert observation.metrics == metrics(waiting=4)  # the last good word stays
    assert observation.age_s == 4.0
    assert (observation.errors_in_a_row, observation.failing_for_s) == (2, 3.0)
    assert observation.last_error == "timeout"
    assert repr(store) == "<MetricsStore pods=1 failing=1>"
    assert store.record_success("p", metrics(waiting=0), now=6.0) == second
    after = store.snapshot(6.0)["p"]
    assert (after.errors_in_a_row, after.failing_for_s, after.last_error) == (0, None, None)
    assert store.record_success("p", metrics(), now=7.0) is None


def test_a_pod_that_never_answered() -> None:
    store = MetricsStore()
    store.record_error("p", "HTTP 500", now=1.0)
    observation = store.snapshot(2.0)["p"]
    assert (observation.metrics, observation.age_s, observation.errors_in_a_row) == (None, None, 1)


def test_the_hit_rate_is_the_ratio_of_counter_increases() -> None:
    store = MetricsStore(hit_rate_half_life_s=10.0)
    store.record_success("p", metrics(5_000, 10_000), now=0.0)
    assert rate(store) is None  # a lifetime ratio says nothing about now: wait for a delta
    store.record_success("p", metrics(5_000, 10_000), now=1.0)
    assert rate(store) is None  # no prompt tokens yet
    store.record_success("p", metrics(5_300, 10_400), now=2.0)
    assert rate(store) == pytest.approx(300 / 400)
    # Weighted by traffic: a small scrape barely moves it (same instant: no decay).
    store.record_success("p", metrics(5_300, 10_410), now=2.0)
    assert rate(store) == pytest.approx(300 / 410)


def test_older_increases_weigh_less_by_half_per_half_life() -> None:
    store = MetricsStore(hit_rate_half_life_s=10.0)
    store.record_success("p", metrics(0, 0), now=0.0)
    store.record_success("p", metrics(100, 100), now=1.0)  # all hits
    store.record_success("p", metrics(100, 200), now=11.0)  # all misses, one half-life later
    assert rate(store) == pytest.approx(50 / 150)
    store.record_success("p", metrics(100, 200), now=1_000.0)  # idle: the rate stays
    assert rate(store) == pytest.approx(50 / 150)


def test_a_counter_reset_counts_the_new_values_as_the_increase() -> None:
    store = MetricsStore(hit_rate_half_life_s=1e9)  # no decay: exact sums
    store.record_success("p", metrics(900, 1_000), now=0.0)
    store.record_success("p", metrics(950, 1_100), now=1.0)  # +50 / +100
    store.record_success("p", metrics(30, 40), now=2.0)  # restarted: +30 / +40
    assert rate(store) == pytest.approx(80 / 140)
    store.record_success("p", metrics(40, 60), now=3.0)  # +10 / +20
    assert rate(store) == pytest.approx(90 / 160)


def saved(store: MetricsStore) -> float | None:
    observation = store.observation("p", now=0.0)
    assert observation is not None
    return observation.cached_tokens_per_request


def _with_requests(hits: float, queries: float, requests: float | None) -> PodMetrics:
    return PodMetrics(
        waiting=0,
        running=1,
        prefix_cache_hits_tokens=hits,
        prefix_cache_queries_tokens=queries,
        requests_finished=requests,
    )


def test_cached_tokens_per_request_are_the_windows_hits_over_its_finished_requests() -> None:
    store = MetricsStore(hit_rate_half_life_s=1e9)  # no decay: exact sums
    store.record_success("p", _with_requests(0, 0, 0), now=0.0)
    assert saved(store) is None
    store.record_success("p", _with_requests(2_048, 2_304, 0), now=1.0)
    assert saved(store) is None  # hits, but no request finished yet
    store.record_success("p", _with_requests(4_096, 4_608, 2), now=2.0)
    assert saved(store) == pytest.approx(4_096 / 2)
    store.record_success("p", _with_requests(4_096, 4_608, 2), now=3.0)  # idle: it stands
    assert saved(store) == pytest.approx(4_096 / 2)
    store.record_success("p", _with_requests(4_096, 4_864, 4), now=4.0)  # two misses
    assert saved(store) == pytest.approx(4_096 / 4)
    store.record_success("p", _with_requests(4_096, 4_864, None), now=5.0)  # no counter
    assert saved(store) is None


def test_prefilled_requests_are_the_denominator_where_the_engine_counts_them() -> None:
    """Hits are counted at the prefill, finished requests up to a long answer later: the
    time-to-first-token count, where a page has it, goes with the hits."""
    store = MetricsStore(hit_rate_half_life_s=1e9)  # no decay: exact sums

    def page(hits: float, prefilled: float | None, finished: float) -> PodMetrics:
        return PodMetrics(
            waiting=0,
            running=4,
            prefix_cache_hits_tokens=hits,
            prefix_cache_queries_tokens=2 * hits + 100,
            requests_finished=finished,
            requests_prefilled=prefilled,
        )

    store.record_success("p", page(0, 0, 0), now=0.0)
    # Four requests prefilled with 256 cached tokens each; one of them finished.
    store.record_success("p", page(1_024, 4, 1), now=1.0)
    assert saved(store) == pytest.approx(256)
    # A page without the histogram: another counter, so a new baseline, then finished.
    store.record_success("p", page(2_048, None, 2), now=2.0)
    assert saved(store) is None
    store.record_success("p", page(3_072, None, 4), now=3.0)
    assert saved(store) == pytest.approx(1_024 / 2)


def test_no_counters_no_rate() -> None:
    store = MetricsStore()
    store.record_success("p", metrics(0, 0), now=0.0)
    store.record_success("p", metrics(10, 20), now=1.0)
    assert rate(store) == 0.5
    store.record_success("p", metrics(), now=2.0)  # an engine without the counters
    assert rate(store) is None
    store.record_success("p", metrics(10, 20), now=3.0)
    assert rate(store) is None  # a new baseline


def test_snapshots_are_immutable_copies() -> None:
    store = MetricsStore()
    store.record_success("a", metrics(waiting=1), now=0.0)
    snapshot = store.snapshot(1.0)
    store.record_success("a", metrics(waiting=9), now=1.0)
    store.record_success("b", metrics(), now=1.0)
    assert snapshot["a"].metrics == metrics(waiting=1) and "b" not in snapshot
    with pytest.raises(TypeError):
        snapshot["b"] = snapshot["a"]  # type: ignore[index]
    store.forget("a")
    store.forget("never-seen")
    assert set(store.snapshot(2.0)) == {"b"}


def test_the_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        MetricsStore(hit_rate_half_life_s=0)


def test_silence_grows_only_while_scrapes_fail_and_down_is_the_last_ones_word() -> None:
    store = MetricsStore()
    store.record_success("p", metrics(), now=10.0)
    # The server stalls for a minute: nothing was tried, so the pod is not silent.
    stalled = store.observation("p", now=70.0)
    assert stalled is not None and stalled.age_s == 60.0 and stalled.silent_s == 0.0
    store.record_error("p", "timeout", now=71.0)
    store.record_error("p", "connect: refused", now=72.5, down=True)
    failing = store.observation("p", now=80.0)
    assert failing is not None and failing.silent_s == 62.5 and failing.down
    store.record_error("p", "timeout", now=74.0)
    slow = store.observation("p", now=80.0)
    assert slow is not None and not slow.down
    store.record_success("p", metrics(), now=75.0)
    back = store.observation("p", now=80.0)
    assert back is not None and back.silent_s == 0.0 and not back.down
    # A pod that never answered is silent from its first failure to its last.
    store.record_error("q", "refused", now=1.0, down=True)
    store.record_error("q", "refused", now=3.0, down=True)
    never = store.observation("q", now=9.0)
    assert never is not None and never.silent_s == 2.0 and never.down


def test_stalled_s_grows_while_the_engine_runs_requests_and_moves_no_token() -> None:
    store = MetricsStore()

    def scrape(at: float, tokens: float | None, running: int = 4) -> float:
        page = PodMetrics(waiting=0, running=running, tokens_processed=tokens)
        store.record_success("p", page, now=at)
        observation = store.observation("p", now=at + 5)  # a snapshot later: no matter
        assert observation is not None
        return observation.stalled_s

    assert scrape(0.0, 100.0) == 0.0
    assert scrape(0.25, 150.0) == 0.0
    revision = store.revision
    assert scrape(0.5, 150.0) == 0.25
    # The same page, but stalled longer: the policy's inputs changed.
    assert scrape(1.5, 150.0) == 1.25 and store.revision > revision
    assert scrape(1.75, 151.0) == 0.0
    # Nothing running, or no counters: never stalled.
    assert scrape(2.0, 151.0, running=0) == 0.0
    assert scrape(3.0, 151.0, running=0) == 0.0
    assert scrape(4.0, None) == 0.0
    assert scrape(5.0, None) == 0.0
    # A restarted engine's counters went down: that is progress.
    assert scrape(5.25, 10.0) == 0.0
