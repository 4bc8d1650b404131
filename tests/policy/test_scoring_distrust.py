"""Distrusted metrics in the weight formula: a pod never believed gets no traffic, and a KV
capacity far beyond the pod's peers' is not believed."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import BalancingConfig, PoolConfig
from xds_server.policy.capacity import capacity_peer_group, median_without
from xds_server.policy.scoring import score_pool
from xds_server.policy.signals import PodSignals
from xds_server.policy.state import Health
from xds_server.tuning import MAX_WEIGHT, Tuning

SETTINGS = BalancingConfig(smoothing=1.0)
HONEST = 80_000  # tokens of KV cache: an H100's, roughly


def pool_of(count: int, *, hardware: list[str | None] | None = None) -> PoolConfig:
    classes = hardware or [None] * count
    return PoolConfig.model_validate(
        {
            "name": "p",
            "models": ["m"],
            "endpoints": [
                {"address": f"10.0.0.{i + 1}", "port": 8000, "hardware": classes[i]}
                for i in range(count)
            ],
        }
    )


def pod(i: int) -> str:
    return f"10.0.0.{i + 1}:8000"


def signals(**overrides: object) -> PodSignals:
    fields: dict[str, object] = {
        "silent_s": 0.0,
        "waiting": 0,
        "running": 4,
        "kv_usage": 0.3,
        "kv_capacity_tokens": HONEST,
    }
    fields.update(overrides)
    return PodSignals(**fields)  # type: ignore[arg-type]


def states(
    pool: PoolConfig,
    pods: dict[str, PodSignals],
    settings: BalancingConfig = SETTINGS,
    memory: dict[str, float] | None = None,
) -> dict[str, tuple[int, Health]]:
    scored = score_pool(pool, settings=settings, signals=pods, memory=memory or {})
    return {e.id: (e.weight, e.health) for e in scored.state.endpoints}


# -- a pod never believed ------------------------------------------------------------------


def test_a_pod_not_scraped_yet_gets_no_traffic_while_its_peers_have_metrics() -> None:
    got = states(pool_of(3), {pod(0): signals(), pod(1): signals()})
    assert got[pod(0)] == got[pod(1)] == (MAX_WEIGHT, Health.HEALTHY)
    assert got[pod(2)] == (1, Health.UNHEALTHY)


def test_a_pod_whose_scrapes_only_failed_gets_no_traffic_even_before_it_is_stale() -> None:
    # Its only verdict is failures (a 500, a page too large, a page not believed): its
    # placeholder signals say idle, and an unknown capacity counts as the largest. Before,
    # that made it the pool's best pod for `stale_after_s`.
    never = signals(scraped=False, waiting=0, running=0, kv_capacity_tokens=None, kv_usage=None)
    got = states(pool_of(3), {pod(0): signals(waiting=3), pod(1): signals(), pod(2): never})
    assert got[pod(2)] == (1, Health.UNHEALTHY)
    assert got[pod(1)] == (MAX_WEIGHT, Health.HEALTHY)
    # Its first believed page puts it in rotation at the next decision.
    got = states(pool_of(3), {pod(0): signals(), pod(1): signals(), pod(2): signals()})
    assert {health for _, health in got.values()} == {Health.HEALTHY}


def test_a_new_pool_none_of_whose_pods_is_scraped_yet_follows_all_stale() -> None:
    # No pod of the pool has spoken: the pool is as in a metrics outage. fail_open serves
    # at equal weights until the first scrape (within one interval), so a new pool does
    # not wait; fail_closed answers 503 until then. Neither lasts: the first good scrape
    # ends it, and from then on only scraped pods are in rotation.
    for pods in ({}, {pod(0): signals(scraped=False), pod(1): signals(scraped=False)}):
        opened = states(pool_of(2), pods)
        assert set(opened.values()) == {(MAX_WEIGHT, Health.HEALTHY)}
        closed = states(pool_of(2), pods, BalancingConfig(smoothing=1.0, all_stale="fail_closed"))
        assert {health for _, health in closed.values()} == {Health.UNHEALTHY}
    first = states(pool_of(2), {pod(0): signals()})
    assert first == {pod(0): (MAX_WEIGHT, Health.HEALTHY), pod(1): (1, Health.UNHEALTHY)}


def test_a_pod_never_scraped_that_refuses_connections_never_fails_open() -> None:
    dead = signals(scraped=False, down=True)
    got = states(pool_of(2), {pod(0): signals(silent_s=9), pod(1): dead})
    assert got[pod(0)][1] is Health.HEALTHY and got[pod(1)] == (1, Health.UNHEALTHY)


def test_in_a_metrics_outage_a_pod_never_scraped_is_on_a_par_with_the_others() -> None:
    stale = {
        pod(0): signals(silent_s=9),
        pod(1): signals(silent_s=9),
        pod(2): signals(scraped=False),
    }
    memory = {pod(0): 1.0, pod(1): 0.25}
    got = states(pool_of(3), stale, memory=memory)
    assert {health for _, health in got.values()} == {Health.HEALTHY}
    # The median of the others' last weights: no more than an honest pod's share.
    assert got[pod(1)][0] <= got[pod(2)][0] <= got[pod(0)][0]


# -- a capacity far beyond the peers' ------------------------------------------------------


def test_a_capacity_far_beyond_the_peers_is_not_believed() -> None:
    liar = signals(kv_capacity_tokens=HONEST * 20)  # under every physical bound, but 20x
    got = states(pool_of(3), {pod(0): signals(), pod(1): signals(), pod(2): liar})
    assert got[pod(2)][1] is Health.UNHEALTHY
    # The honest pods keep their weights: the liar's claim does not shrink their capacity.
    assert got[pod(0)] == got[pod(1)] == (MAX_WEIGHT, Health.HEALTHY)
    # Within the ratio, a bigger pod is a bigger pod (unlabelled pools may mix GPUs: an
    # H100 has 12x an A10G's blocks).
    bigger = signals(kv_capacity_tokens=HONEST * 12)
    got = states(pool_of(3), {pod(0): signals(), pod(1): signals(), pod(2): bigger})
    assert got[pod(2)] == (MAX_WEIGHT, Health.HEALTHY) and got[pod(0)][0] < MAX_WEIGHT / 1000
    # The ratio is a setting.
    strict = BalancingConfig(smoothing=1.0, max_capacity_ratio=8)
    got = states(pool_of(3), {pod(0): signals(), pod(1): signals(), pod(2): bigger}, strict)
    assert got[pod(2)][1] is Health.UNHEALTHY


def test_with_fewer_than_two_peers_nothing_is_compared() -> None:
    # One peer cannot tell who lies: a pod claiming a tiny cache would get its only,
    # honest, peer refused. The physical bounds (engines.py) still hold.
    assert Tuning().min_capacity_peers == 2
    liar = signals(kv_capacity_tokens=HONEST * 20)
    got = states(pool_of(2), {pod(0): signals(), pod(1): liar})
    assert {health for _, health in got.values()} == {Health.HEALTHY}
    tiny = signals(kv_capacity_tokens=10)
    got = states(pool_of(3), {pod(0): signals(), pod(1): signals(), pod(2): tiny})
    assert got[pod(0)][1] is got[pod(1)][1] is Health.HEALTHY


def test_peers_are_the_pods_of_the_same_hardware_class() -> None:
    pool = pool_of(5, hardware=["h100", "h100", "a10g", "a10g", "a10g"])
    h100 = signals(kv_capacity_tokens=HONEST)
    a10g = signals(kv_capacity_tokens=HONEST // 12)
    pods = {pod(0): h100, pod(1): h100, pod(2): a10g, pod(3): a10g, pod(4): a10g}
    assert {health for _, health in states(pool, pods).values()} == {Health.HEALTHY}
    # An A10G claiming an H100's cache is 12x its class's median: refused at ratio 8.
    pods[pod(4)] = h100
    got = states(pool, pods, BalancingConfig(smoothing=1.0, max_capacity_ratio=8))
    assert got[pod(4)][1] is Health.UNHEALTHY
    assert {got[pod(i)][1] for i in range(4)} == {Health.HEALTHY}
    # A class with a configured capacity does not use KV capacity: not compared.
    settings = BalancingConfig(
        smoothing=1.0, max_capacity_ratio=8, hardware_capacity={"a10g": 1.0, "h100": 12.0}
    )
    assert capacity_peer_group(pool, pool.endpoints[4], settings) is None
    assert capacity_peer_group(pool, pool.endpoints[4], SETTINGS) == "p/a10g"
    assert {health for _, health in states(pool, pods, settings).values()} == {Health.HEALTHY}


def test_stale_peers_are_not_peers() -> None:
    liar = signals(kv_capacity_tokens=HONEST * 20)
    got = states(
        pool_of(3), {pod(0): signals(), pod(1): signals(silent_s=9), pod(2): liar}
    )  # one fresh peer only
    assert got[pod(2)][1] is Health.HEALTHY and got[pod(1)][1] is Health.UNHEALTHY


@given(st.lists(st.integers(min_value=1, max_value=10**9), min_size=2, max_size=30), st.data())
def test_median_without_one_value_is_the_median_of_the_rest(
    values: list[int], data: st.DataObject
) -> None:
    ordered = sorted(values)
    value = data.draw(st.sampled_from(values))
    rest = list(values)
    rest.remove(value)
    assert median_without(ordered, value) == pytest.approx(statistics.median(rest))
    absent = data.draw(st.integers(min_value=-5, max_value=0))
    assert median_without(ordered, absent) == pytest.approx(statistics.median(values))
    assert median_without(ordered, None) == pytest.approx(statistics.median(values))


def _weights(pods: dict[str, PodSignals], slowness: dict[str, int]) -> dict[str, int]:
    scored = score_pool(pool_of(4), settings=SETTINGS, signals=pods, memory={}, slowness=slowness)
    return {e.id: e.weight for e in scored.state.endpoints}


def test_a_slow_pod_claiming_more_than_its_peers_counts_as_their_median() -> None:
    pods = {pod(i): signals() for i in range(4)}
    liar = pod(0)
    pods[liar] = signals(kv_capacity_tokens=4 * HONEST, kv_usage=0.3 / 4)
    believed = _weights(pods, {})
    # Four times the cache: the capacity exponent gives it nearly all the traffic.
    assert believed[liar] == MAX_WEIGHT
    assert max(w for p, w in believed.items() if p != liar) < MAX_WEIGHT / 100

    def share(weights: dict[str, int]) -> float:
        return weights[liar] / sum(weights.values())

    assert share(believed) > 0.98
    for steps in (1, 4):
        assert share(_weights(pods, {liar: steps})) == pytest.approx(0.25, abs=0.02)


def test_slowness_leaves_the_claims_of_pods_that_claim_no_more_than_their_peers() -> None:
    pods = {pod(i): signals() for i in range(4)}
    small = pod(3)
    pods[small] = signals(kv_capacity_tokens=HONEST // 4)
    assert _weights(pods, {small: 4}) == _weights(pods, {})


def test_the_median_a_slow_liar_is_held_to_counts_slow_peers_too() -> None:
    pods = {pod(i): signals() for i in range(4)}
    liar = pod(0)
    pods[liar] = signals(kv_capacity_tokens=4 * HONEST, kv_usage=0.3 / 4)
    every_pod_slow = _weights(pods, dict.fromkeys(pods, 1))
    assert every_pod_slow[liar] / sum(every_pod_slow.values()) == pytest.approx(0.25, abs=0.02)


def test_a_slow_pod_whose_claim_its_like_vouch_for_keeps_it() -> None:
    """Two large pods and two twelve times smaller (H100s and A10Gs): a busy large pod
    that falls behind the other's pace is not taken for a small one, even when both are."""
    pods = {pod(i): signals() for i in range(4)}
    for small in (pod(2), pod(3)):
        pods[small] = signals(kv_capacity_tokens=HONEST // 12)
    trusted = _weights(pods, {})
    assert _weights(pods, {pod(0): 2}) == trusted
    assert _weights(pods, {pod(0): 1, pod(1): 3}) == trusted
    # The small pods keep a tiny share: 12 times smaller, to the capacity exponent.
    assert max(trusted[pod(2)], trusted[pod(3)]) < MAX_WEIGHT / 1_000
    # A liar claiming the large pods' size among small pods finds nobody to vouch for it.
    liars = {pod(i): signals(kv_capacity_tokens=HONEST // 12) for i in range(4)}
    liars[pod(0)] = signals(kv_capacity_tokens=HONEST)
    caught = _weights(liars, {pod(0): 1})
    assert caught[pod(0)] / sum(caught.values()) == pytest.approx(0.25, abs=0.02)


def _health(pods: dict[str, PodSignals], **extra: object) -> dict[str, tuple[Health, str | None]]:
    scored = score_pool(pool_of(4), settings=SETTINGS, signals=pods, memory={}, **extra)  # type: ignore[arg-type]
    return {e.id: (e.health, e.verdict) for e in scored.state.endpoints}


def test_an_engine_that_runs_requests_and_moves_no_token_is_out_until_it_does() -> None:
    pods = {pod(i): signals() for i in range(4)}
    pods[pod(0)] = signals(stalled_s=SETTINGS.stall_after_s)
    health = _health(pods)
    assert health[pod(0)] == (Health.UNHEALTHY, "stalled")
    assert {health[pod(i)] for i in (1, 2, 3)} == {(Health.HEALTHY, None)}
    # Prefilling a long prompt alone moves no token for seconds: not a stall.
    assert _health(pods, long_prompts={pod(0): 1})[pod(0)] == (Health.HEALTHY, None)
    # Half the pool may be out so; more, and the counters are not believed.
    pods[pod(1)] = signals(stalled_s=5.0)
    assert sum(h is Health.UNHEALTHY for h, _ in _health(pods).values()) == 2
    pods[pod(2)] = signals(stalled_s=5.0)
    assert all(h is Health.HEALTHY for h, _ in _health(pods).values())
