"""Whether a pool's session keys stick (xds_server/policy/affinity.py)."""

from __future__ import annotations

from xds_server.config import BalancingConfig, PoolConfig
from xds_server.policy.affinity import AffinityMemory, affinity, cached_tokens_per_request
from xds_server.policy.scoring import score_pool
from xds_server.policy.signals import PodSignals
from xds_server.tuning import Tuning

TUNING = Tuning()
STREAK = int(TUNING.affinity_streak_intervals)
MINIMUM = TUNING.affinity_min_cached_tokens
PODS = ("a", "b", "c")


def _fresh(saved: float | None, running: float = 4.0) -> dict[str, PodSignals]:
    return {
        k: PodSignals(silent_s=0.0, waiting=0.0, running=running, cached_tokens_per_request=saved)
        for k in PODS
    }


def _run(
    saved: float | None,
    decisions: int,
    memory: AffinityMemory,
    running: float = 4.0,
    returns: float | None = None,
):
    result = None
    shares = None if returns is None else dict.fromkeys(PODS, returns)
    for _ in range(decisions):
        result = affinity(PODS, _fresh(saved, running), memory, TUNING, shares)
        memory = result.memory
    assert result is not None
    return result


def test_short_cached_prefixes_suspend_the_keys_after_a_streak() -> None:
    almost = _run(0.4 * MINIMUM, STREAK - 1, AffinityMemory())
    assert not almost.memory.suspended and almost.reason is None
    suspended = _run(0.4 * MINIMUM, 1, almost.memory)
    assert suspended.memory.suspended
    assert suspended.reason is not None and suspended.reason.code == "affinity_suspended"
    assert f"saves {0.4 * MINIMUM:.0f} prompt tokens" in suspended.reason.detail


def test_long_cached_prefixes_keep_the_keys() -> None:
    assert not _run(4 * MINIMUM, 3 * STREAK, AffinityMemory()).memory.suspended


def test_a_streak_broken_by_one_long_figure_starts_again() -> None:
    memory = _run(0.4 * MINIMUM, STREAK - 1, AffinityMemory()).memory
    memory = _run(2 * MINIMUM, 1, memory).memory
    assert memory.streak == 0
    assert not _run(0.4 * MINIMUM, STREAK - 1, memory).memory.suspended


def test_suspended_keys_stick_again_only_past_the_hysteresis() -> None:
    suspended = AffinityMemory(suspended=True)
    between = MINIMUM * (1 + TUNING.affinity_resume_factor) / 2
    assert _run(between, 3 * STREAK, suspended).memory.suspended
    past = 1.01 * MINIMUM * TUNING.affinity_resume_factor
    assert not _run(past, STREAK, suspended).memory.suspended


def test_an_idle_pool_or_pods_that_do_not_say_change_nothing() -> None:
    assert not _run(None, 3 * STREAK, AffinityMemory()).memory.suspended
    assert not _run(0.0, 3 * STREAK, AffinityMemory(), running=0.0).memory.suspended
    assert _run(None, 3 * STREAK, AffinityMemory(suspended=True)).memory.suspended


def test_the_pool_figure_weighs_pods_by_what_they_hold() -> None:
    fresh = {
        "a": PodSignals(silent_s=0.0, waiting=2.0, running=7.0, cached_tokens_per_request=100.0),
        "b": PodSignals(silent_s=0.0, waiting=0.0, running=0.0, cached_tokens_per_request=1000.0),
        "c": PodSignals(silent_s=0.0, waiting=0.0, running=3.0),
    }
    assert cached_tokens_per_request(PODS, fresh) == (100.0 * 9 + 1000.0 * 1) / 10


def test_a_cold_start_is_judged_by_the_requests_that_returned() -> None:
    # A fresh fleet: a quarter of the keyed requests returned to their key's pod, each
    # saving 2.4x the minimum; per request that reads as 0.6x, which would suspend the keys.
    cold = 0.6 * MINIMUM
    assert _run(cold, STREAK, AffinityMemory()).memory.suspended
    assert not _run(cold, 3 * STREAK, AffinityMemory(), returns=0.25).memory.suspended
    # Short prefixes stay short per return: most requests returned, and still save little.
    assert _run(0.3 * MINIMUM, STREAK, AffinityMemory(), returns=0.8).memory.suspended
    # No request returned yet: nothing to judge by, sticky; and no streak kept.
    nothing = _run(0.1 * MINIMUM, 3 * STREAK, AffinityMemory(), returns=0.0)
    assert not nothing.memory.suspended and nothing.memory.streak == 0


def test_suspended_keys_are_judged_per_request_whatever_returned() -> None:
    # Spread by load, keys return to a pod by chance: what any pod saves is the figure.
    suspended = AffinityMemory(suspended=True)
    short = 0.5 * MINIMUM
    result = _run(short, 3 * STREAK, suspended, returns=0.1)
    assert result.memory.suspended
    assert result.reason is not None and f"saves {short:.0f} prompt tokens" in result.reason.detail


def test_per_return_each_pod_is_divided_by_its_own_share() -> None:
    fresh = {
        "a": PodSignals(silent_s=0.0, waiting=0.0, running=3.0, cached_tokens_per_request=300.0),
        "b": PodSignals(silent_s=0.0, waiting=0.0, running=1.0, cached_tokens_per_request=100.0),
        "c": PodSignals(silent_s=0.0, waiting=0.0, running=1.0, cached_tokens_per_request=0.0),
    }
    # a: half its keyed requests returned; b: the log has no word of it (per request); c:
    # none returned (a pod that replaced another, all first requests): it says nothing.
    returns = {"a": 0.5, "c": 0.0, "gone": 0.9}
    assert cached_tokens_per_request(PODS, fresh, returns) == (600.0 * 3 + 100.0) / 4
    assert cached_tokens_per_request(PODS, fresh, {k: 0.0 for k in PODS}) is None


def _pool(spill_to: str) -> tuple[PoolConfig, BalancingConfig]:
    pool = PoolConfig.model_validate(
        {
            "name": "p",
            "models": ["m"],
            "session_affinity": True,
            "endpoints": [{"address": "10.0.0.1", "port": 8000 + i} for i in range(3)],
        }
    )
    return pool, BalancingConfig.model_validate({"spill_to": spill_to})


def test_score_pool_judges_the_figure_per_return() -> None:
    signals = {
        f"10.0.0.1:{8000 + i}": PodSignals(
            silent_s=0.0, waiting=0.0, running=4.0, cached_tokens_per_request=300.0
        )
        for i in range(3)
    }
    pool, settings = _pool("pool")
    # 300 tokens per request: under the minimum, unless only a fifth of the requests
    # returned to their key's pod (1,500 per return).
    for share, expected in ((None, True), (0.2, False), (0.9, True)):
        key_returns = None if share is None else dict.fromkeys(signals, share)
        memory, keys, scored = {}, AffinityMemory(), None
        for _ in range(STREAK):
            scored = score_pool(
                pool,
                settings=settings,
                signals=signals,
                memory=memory,
                keys=keys,
                key_returns=key_returns,
            )
            memory, keys = scored.memory, scored.affinity
        assert scored is not None
        assert scored.state.keys_suspended is expected, share


def test_score_pool_suspends_a_pools_keys_with_the_reason_on_every_healthy_pod() -> None:
    signals = {
        f"10.0.0.1:{8000 + i}": PodSignals(
            silent_s=0.0, waiting=0.0, running=4.0, cached_tokens_per_request=0.3 * MINIMUM
        )
        for i in range(3)
    }
    for spill_to, expected in (("pool", True), ("ring", False)):
        pool, settings = _pool(spill_to)
        memory, keys, scored = {}, AffinityMemory(), None
        for _ in range(STREAK):
            scored = score_pool(pool, settings=settings, signals=signals, memory=memory, keys=keys)
            memory, keys = scored.memory, scored.affinity
        assert scored is not None
        assert scored.state.keys_suspended is expected, spill_to
        codes = [[r.code for r in e.reasons] for e in scored.state.endpoints]
        assert codes == [["affinity_suspended"] if expected else []] * 3, spill_to
