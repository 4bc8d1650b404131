"""Pod metrics as the policy's input: signals of pods never believed, the peers' check of KV
capacities, and the scraper following the config's limits."""

from __future__ import annotations

import pytest

from xds_server.config import RoutingConfig
from xds_server.errors import ImplausibleMetricsError, ScrapeErrorKind
from xds_server.metrics.engines import PodMetrics
from xds_server.metrics.scraper import Scraper
from xds_server.metrics.store import MetricsStore
from xds_server.sources.pod_metrics import (
    CapacityCheck,
    PodMetricsSource,
    follow_config,
    signals_of,
)

HONEST = 80_000


def config(**balancing: object) -> RoutingConfig:
    """Pool `p`: pods .1-.4 without a hardware class, .5 and .6 of class `big` (configured
    in `hardware_capacity` when `balancing` says so); pool `q` shares .1 and .2 with .7."""
    return RoutingConfig.model_validate(
        {
            "balancing": balancing,
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "endpoints": [
                        *({"address": f"10.0.0.{i}", "port": 8000} for i in range(1, 5)),
                        *(
                            {"address": f"10.0.0.{i}", "port": 8000, "hardware": "big"}
                            for i in (5, 6)
                        ),
                    ],
                },
                {
                    "name": "q",
                    "models": ["n"],
                    "endpoints": [{"address": f"10.0.0.{i}", "port": 8000} for i in (1, 2, 7)],
                },
            ],
        }
    )


def pod(i: int) -> str:
    return f"10.0.0.{i}:8000"


def metrics(capacity: int | None = HONEST) -> PodMetrics:
    return PodMetrics(waiting=0, running=1, kv_capacity_tokens=capacity)


def test_signals_of_a_pod_whose_scrapes_only_failed_say_it_was_never_scraped() -> None:
    store = MetricsStore()
    assert store.observation("a", now=0.0) is None
    store.record_error("a", "HTTP 500", now=1.0)
    observation = store.observation("a", now=2.0)
    assert observation is not None
    never = signals_of(observation)
    assert never is not None and not never.scraped and not never.down
    store.record_success("a", metrics(), now=3.0)
    observation = store.observation("a", now=3.0)
    assert observation is not None
    scraped = signals_of(observation)
    assert scraped is not None and scraped.scraped and scraped.kv_capacity_tokens == HONEST
    # A page refused later does not undo that: the last good metrics age out.
    store.record_error("a", "not believed", now=4.0)
    observation = store.observation("a", now=4.0)
    assert observation is not None
    stale = signals_of(observation)
    assert stale is not None and stale.scraped and stale.silent_s == 1.0


def test_a_capacity_is_compared_once_two_peers_have_a_believed_one() -> None:
    check = CapacityCheck(config())
    liar = metrics(HONEST * 20)
    check(pod(3), liar)  # no peers yet: only the physical bounds hold (engines.py)
    check(pod(1), metrics())
    check(pod(3), liar)  # one peer (and itself): still nothing to compare with
    check(pod(2), metrics())
    with pytest.raises(ImplausibleMetricsError) as caught:
        check(pod(3), liar)
    error = caught.value
    assert error.kind is ScrapeErrorKind.IMPLAUSIBLE
    assert str(error) == (
        "the KV cache capacity (tokens) is 1.6e+06, over 16 times the median (80000) of its "
        "2 peers in pool p, no hardware class (balancing.max_capacity_ratio): not believed"
    )
    # Its own earlier, unchecked claim is not one of its peers'.
    with pytest.raises(ImplausibleMetricsError):
        check(pod(3), metrics(HONEST * 17))
    check(pod(3), metrics(HONEST * 15))  # within the ratio
    check(pod(4), metrics())


def test_a_refused_capacity_is_not_remembered() -> None:
    check = CapacityCheck(config(max_capacity_ratio=4))
    for i in (1, 2):
        check(pod(i), metrics())
    with pytest.raises(ImplausibleMetricsError):
        check(pod(3), metrics(HONEST * 100))
    # Had it been remembered, the median of .4's peers would be (80k + 8M) / 2.
    with pytest.raises(ImplausibleMetricsError, match="median \\(80000\\) of its 2 peers"):
        check(pod(4), metrics(HONEST * 5))


def test_pods_are_compared_within_their_hardware_class_and_every_pool() -> None:
    check = CapacityCheck(config(max_capacity_ratio=4))
    for i in (1, 2, 3):
        check(pod(i), metrics())
    check(pod(5), metrics(HONEST * 12))  # class big: its peers are .6 alone
    check(pod(6), metrics(HONEST * 12))
    # .7 is in pool q with .1 and .2.
    with pytest.raises(ImplausibleMetricsError, match="peers in pool q, no hardware class"):
        check(pod(7), metrics(HONEST * 5))
    # A class with a configured capacity is not compared: its KV capacity is not used.
    configured = CapacityCheck(config(hardware_capacity={"big": 12.0}))
    assert "pods=5" in repr(configured)  # of 7: .5 and .6 are not checked
    configured(pod(5), metrics(HONEST * 1000))


def test_a_check_built_for_a_new_config_starts_from_the_stores_believed_metrics() -> None:
    store = MetricsStore()
    for i in (1, 2):
        store.record_success(pod(i), metrics(), now=0.0)
    store.record_error(pod(3), "refused", now=0.0)
    check = CapacityCheck(config(), store=store)
    assert repr(check) == "<CapacityCheck pods=7 believed=2>"
    with pytest.raises(ImplausibleMetricsError):
        check(pod(3), metrics(HONEST * 20))
    check(pod(3), metrics(None))  # no capacity said: nothing to compare


def test_follow_config_sets_the_page_cap_the_check_and_the_targets() -> None:
    scraper = Scraper(MetricsStore())
    assert scraper.max_page_bytes == 1 << 20 and scraper.check is None
    follow_config(scraper, config(max_metrics_page_bytes=200_000, scrape_interval_s=0.5))
    assert scraper.max_page_bytes == 200_000 and scraper.interval_s == 0.5
    assert isinstance(scraper.check, CapacityCheck)
    assert set(scraper.targets) == {pod(i) for i in range(1, 8)}


def test_the_limits_are_validated_config() -> None:
    defaults = config().balancing
    assert (defaults.max_metrics_page_bytes, defaults.max_capacity_ratio) == (1 << 20, 16.0)
    for bad in ({"max_metrics_page_bytes": 1000}, {"max_capacity_ratio": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            config(**bad)


def test_signals_are_the_same_object_until_a_page_says_something_new() -> None:
    """The controller skips a decision whose inputs are the last one's objects: a scrape
    that reads the same page must not make new signals (nor a prefix-cache rate that only
    decays), and one that reads a different page must."""
    store = MetricsStore()
    source = PodMetricsSource(store, clock=lambda: 0.0)
    page = PodMetrics(
        waiting=0, running=2, prefix_cache_hits_tokens=40.0, prefix_cache_queries_tokens=100.0
    )
    later = PodMetrics(
        waiting=0, running=2, prefix_cache_hits_tokens=70.0, prefix_cache_queries_tokens=150.0
    )
    store.record_success("a", page, now=1.0)
    store.record_success("a", later, now=2.0)
    first = source.signals(2.0)
    for second in range(3, 30):  # the same page again and again, the rate's sums decaying
        store.record_success("a", later, now=float(second))
        assert source.signals(float(second)) is first
    store.record_success("a", PodMetrics(**{**vars(page), "waiting": 4}), now=31.0)
    changed = source.signals(31.0)
    assert changed is not first and changed["a"].waiting == 4
    store.record_error("a", "timed out", now=32.0)
    assert source.signals(32.0) is not changed
