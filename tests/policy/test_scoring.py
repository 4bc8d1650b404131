"""The weight formula: capacity, saturation, smoothing, quantization, staleness."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest

from xds_server.config import BalancingConfig, EndpointConfig, PoolConfig
from xds_server.policy.scoring import ScoredPool, score_pool
from xds_server.policy.signals import PodSignals
from xds_server.policy.state import Health
from xds_server.tuning import MAX_WEIGHT, Tuning

POOL = PoolConfig.model_validate(
    {
        "name": "p",
        "models": ["m"],
        "endpoints": [{"address": "10.0.0.1", "port": 8000}, {"address": "10.0.0.2", "port": 8000}],
    }
)
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
SETTINGS = BalancingConfig(smoothing=1.0)


def signals(**overrides: object) -> PodSignals:
    fields: dict[str, object] = {
        "silent_s": 0.0,
        "waiting": 0,
        "running": 4,
        "kv_usage": 0.3,
        "kv_capacity_tokens": 80_000,
    }
    fields.update(overrides)
    return PodSignals(**fields)  # type: ignore[arg-type]


def weights(
    pool_signals: dict[str, PodSignals], settings: BalancingConfig = SETTINGS, **kw: object
) -> dict[str, tuple[int, Health]]:
    scored = score_pool(
        POOL, settings=settings, signals=pool_signals, memory=kw.pop("memory", {}), **kw
    )  # type: ignore[arg-type]
    return {f"{e.address}:{e.port}": (e.weight, e.health) for e in scored.state.endpoints}


def test_identical_pods_get_identical_weights_despite_noise() -> None:
    got = weights({A: signals(running=10, kv_usage=0.31), B: signals(running=11, kv_usage=0.33)})
    assert got[A] == got[B] == (MAX_WEIGHT, Health.HEALTHY)


def test_capacity_from_kv_cache_size() -> None:
    got = weights({A: signals(kv_capacity_tokens=80_000), B: signals(kv_capacity_tokens=6_656)})
    assert got[A][0] == MAX_WEIGHT
    assert got[B][0] == pytest.approx(MAX_WEIGHT / 12**4, rel=0.1)  # capacity exponent 4


def test_capacity_from_hardware_class_wins() -> None:
    pool = POOL.model_copy(
        update={
            "endpoints": tuple(
                e.model_copy(update={"hardware": h})
                for e, h in zip(POOL.endpoints, ["h100", "a10g"], strict=True)
            )
        }
    )
    settings = BalancingConfig(smoothing=1.0, hardware_capacity={"h100": 13.0, "a10g": 1.0})
    scored = score_pool(pool, settings=settings, signals={A: signals(), B: signals()}, memory={})
    a, b = scored.state.endpoints
    assert a.weight == MAX_WEIGHT and b.weight == pytest.approx(MAX_WEIGHT / 13**4, rel=0.2)


def test_queue_and_full_kv_cut_the_weight() -> None:
    got = weights({A: signals(), B: signals(waiting=2)})  # one beyond the slack
    assert got[B][0] == pytest.approx(MAX_WEIGHT / 4, rel=0.15)
    got = weights({A: signals(), B: signals(kv_usage=0.95)})
    assert got[B][0] == pytest.approx(MAX_WEIGHT * 0.0625, rel=0.15)  # (0.25)^2


def test_a_pod_holding_long_prompts_is_cut_by_the_factor_per_prompt() -> None:
    pods = {A: signals(), B: signals()}
    assert weights(pods, long_prompts={B: 1})[B][0] == pytest.approx(MAX_WEIGHT / 100, rel=0.15)
    assert weights(pods, long_prompts={B: 2})[B][0] == pytest.approx(MAX_WEIGHT / 1e4, rel=0.15)
    settings = BalancingConfig(smoothing=1.0, long_prompt_weight_factor=0.5)
    got = weights(pods, settings, long_prompts={A: 1})
    assert got[A][0] == pytest.approx(MAX_WEIGHT / 2, rel=0.15) and got[B][0] == MAX_WEIGHT
    # Relative: when every pod has one, none is preferred.
    both = weights(pods, long_prompts={A: 1, B: 1})
    assert both[A] == both[B] == (MAX_WEIGHT, Health.HEALTHY)


def test_the_long_prompt_cut_is_neither_smoothed_nor_remembered() -> None:
    settings = BalancingConfig(smoothing=0.5)
    pods = {A: signals(), B: signals()}
    during = score_pool(POOL, settings=settings, signals=pods, memory={}, long_prompts={B: 1})
    assert during.state.endpoints[1].weight == pytest.approx(MAX_WEIGHT / 100, rel=0.15)
    after = score_pool(POOL, settings=settings, signals=pods, memory=during.memory)
    assert after.memory == during.memory
    assert [e.weight for e in after.state.endpoints] == [MAX_WEIGHT, MAX_WEIGHT]


def test_smoothing_moves_halfway() -> None:
    settings = BalancingConfig(smoothing=0.5)
    first = score_pool(POOL, settings=settings, signals={A: signals(), B: signals()}, memory={})
    second = score_pool(
        POOL, settings=settings, signals={A: signals(), B: signals(waiting=3)}, memory=first.memory
    )
    weight_b = second.state.endpoints[1].weight
    # Raw score of B fell to 1/16; smoothed it is about half of the old one.
    assert MAX_WEIGHT * 0.4 <= weight_b <= MAX_WEIGHT * 0.65


def test_stale_pod_leaves_rotation_and_returns() -> None:
    got = weights({A: signals(), B: signals(silent_s=5.0)})
    assert got[A][1] is Health.HEALTHY and got[B][1] is Health.UNHEALTHY
    assert weights({A: signals(), B: signals(silent_s=0.2)})[B][1] is Health.HEALTHY


def test_all_stale_fails_open_or_closed() -> None:
    stale = {A: signals(silent_s=9), B: signals(silent_s=9)}
    memory = {A: 1.0, B: 0.25}
    opened = weights(stale, memory=memory)
    assert {h for _, h in opened.values()} == {Health.HEALTHY}
    assert opened[A][0] > opened[B][0]  # the last weights stay
    closed = weights(stale, BalancingConfig(smoothing=1.0, all_stale="fail_closed"), memory=memory)
    assert {h for _, h in closed.values()} == {Health.UNHEALTHY}


def test_a_pod_that_refuses_connections_leaves_at_once_and_never_fails_open() -> None:
    # Down at the first refused scrape, long before its metrics would be stale.
    got = weights({A: signals(), B: signals(down=True)})
    assert got[A][1] is Health.HEALTHY and got[B][1] is Health.UNHEALTHY
    # A metrics outage (A stale) keeps A in rotation on fail_open, but not the dead B.
    outage = weights({A: signals(silent_s=9), B: signals(silent_s=9, down=True)})
    assert outage[A][1] is Health.HEALTHY and outage[B][1] is Health.UNHEALTHY
    # Back once a scrape succeeds.
    assert weights({A: signals(), B: signals()})[B][1] is Health.HEALTHY


def test_unscraped_pod_is_out_of_rotation_and_draining_is_marked() -> None:
    # tests/policy/test_scoring_distrust.py has the rest of the story of unscraped pods.
    assert weights({A: signals()})[B] == (1, Health.UNHEALTHY)
    got = weights({A: signals()}, draining=frozenset({B}))
    assert got[B] == (1, Health.DRAINING)


def test_adapters_become_endpoint_state() -> None:
    scored = score_pool(
        POOL, settings=SETTINGS, signals={A: signals(adapters=("b", "a")), B: signals()}, memory={}
    )
    assert (
        scored.state.endpoints[0].adapters == ("a", "b")
        and scored.state.endpoints[1].adapters == ()
    )


def test_capacity_exponent_shapes_the_split() -> None:
    pool = POOL.model_copy(
        update={
            "endpoints": tuple(
                e.model_copy(update={"hardware": h})
                for e, h in zip(POOL.endpoints, ["h100", "a100"], strict=True)
            )
        }
    )
    signals_ = {A: signals(), B: signals()}
    for exponent, expected in ((1.0, MAX_WEIGHT / 2), (3.0, MAX_WEIGHT / 8)):
        settings = BalancingConfig.model_validate(
            {
                "smoothing": 1.0,
                "hardware_capacity": {"h100": 2.0, "a100": 1.0},
                "scorers": {"capacity": exponent},
            }
        )
        _, b = score_pool(pool, settings=settings, signals=signals_, memory={}).state.endpoints
        assert b.weight == pytest.approx(expected, rel=0.08)


LORA_POOL = POOL.model_copy(update={"adapters": ("a", "b", "c")})


def adapters_of(pool_signals: dict[str, PodSignals]) -> dict[str, tuple[str, ...]]:
    scored = score_pool(LORA_POOL, settings=SETTINGS, signals=pool_signals, memory={})
    return {f"{e.address}:{e.port}": e.adapters for e in scored.state.endpoints}


def test_an_adapter_no_pod_holds_is_placed_on_a_pod_with_a_free_slot() -> None:
    got = adapters_of(
        {
            A: signals(adapters=("a", "b"), running_adapters=("a", "b"), max_adapters=2),
            B: signals(adapters=("a",), running_adapters=("a",), max_adapters=2),
        }
    )
    # c goes where it can load at once (B's second slot), not to A's full batch.
    assert got == {A: ("a", "b"), B: ("a", "c")}


def test_adapters_placed_at_a_cold_start_spread_over_the_pods_with_most_free_slots() -> None:
    empty = signals(adapters=(), running_adapters=(), max_adapters=2)
    # Not a and b on the best-scoring pod A: the two most wanted adapters would share it.
    assert adapters_of({A: empty, B: empty}) == {A: ("a", "c"), B: ("b",)}


def test_configured_adapter_slots_place_adapters_before_any_pod_reports_its_own() -> None:
    # vLLM reports max_lora only once it has served a LoRA request.
    unreported = signals(adapters=(), running_adapters=())
    assert adapters_of({A: unreported, B: unreported}) == {A: (), B: ()}
    pool = LORA_POOL.model_copy(update={"adapter_slots": 2})
    scored = score_pool(pool, settings=SETTINGS, signals={A: unreported, B: unreported}, memory={})
    assert sorted(e.adapters for e in scored.state.endpoints) == [("a", "c"), ("b",)]
    # No pod scraped yet (the pool fails open): nothing to place on, nothing advertised.
    blind = score_pool(pool, settings=SETTINGS, signals={}, memory={})
    assert [e.adapters for e in blind.state.endpoints] == [(), ()]


def test_the_first_deal_of_adapters_follows_the_pods_names_not_their_addresses() -> None:
    """Equal pods tie, and the tie falls by name: pods that come back with other addresses
    (or the benchmark's pods, on other ports every run) get the same adapters."""
    unreported = signals(adapters=(), running_adapters=())

    def deal(names: tuple[str, str]) -> dict[str, tuple[str, ...]]:
        endpoints = [
            {"address": "10.0.0.1", "port": 8000, "name": names[0]},
            {"address": "10.0.0.2", "port": 8000, "name": names[1]},
        ]
        pool = LORA_POOL.model_copy(
            update={
                "adapter_slots": 2,
                "endpoints": tuple(EndpointConfig.model_validate(e) for e in endpoints),
            }
        )
        scored = score_pool(
            pool, settings=SETTINGS, signals={A: unreported, B: unreported}, memory={}
        )
        return {e.ring_key: e.adapters for e in scored.state.endpoints}

    assert deal(("pod-0", "pod-1")) == {"pod-0": ("a", "c"), "pod-1": ("b",)}
    assert deal(("pod-1", "pod-0")) == {"pod-0": ("a", "c"), "pod-1": ("b",)}


def test_a_waiting_adapter_beyond_the_slots_is_not_advertised() -> None:
    got = adapters_of(
        {
            A: signals(adapters=("a", "b", "c"), running_adapters=("a", "b"), max_adapters=2),
            B: signals(adapters=(), running_adapters=(), max_adapters=2),
        }
    )
    # c waits in A for a slot; its next requests go to B, which has two free.
    assert got == {A: ("a", "b"), B: ("c",)}


def test_a_hot_adapter_whose_holders_queue_spills_to_a_free_slot() -> None:
    got = adapters_of(
        {
            A: signals(waiting=3, adapters=("a",), running_adapters=("a",), max_adapters=1),
            B: signals(adapters=(), running_adapters=(), max_adapters=3),
        }
    )
    assert got[B] == ("a", "b", "c")  # b and c (held nowhere) placed, then a spilled
    quiet = adapters_of(
        {
            A: signals(waiting=0, adapters=("a",), running_adapters=("a",), max_adapters=1),
            B: signals(adapters=(), running_adapters=(), max_adapters=1),
        }
    )
    # No spill without a queue; c, with no free slot left (more adapters than slots),
    # waits for one on B: as loaded as A for its capacity, with as many adapters per slot,
    # and its adapter is listed last (it drains soonest).
    assert quiet == {A: ("a",), B: ("b", "c")}


def test_pods_that_do_not_report_slots_keep_their_adapters() -> None:
    got = adapters_of({A: signals(adapters=("a", "c")), B: signals()})
    assert got == {A: ("a", "c"), B: ()}


def test_with_no_free_slot_an_unheld_adapter_takes_one_from_an_adapter_held_twice() -> None:
    got = adapters_of(
        {
            A: signals(adapters=("a", "b"), running_adapters=("a", "b"), max_adapters=2),
            B: signals(adapters=("a", "c"), running_adapters=("a",), max_adapters=1),
        }
    )
    # c waits in B beyond its slot; a is held twice, so A gives a's slot to c.
    assert got == {A: ("b", "c"), B: ("a",)}


def test_one_waiting_request_is_slack_by_default() -> None:
    # A request that arrived during an engine step waits for the next one: not a queue.
    assert weights({A: signals(waiting=1), B: signals()})[A] == (MAX_WEIGHT, Health.HEALTHY)
    got = weights({A: signals(waiting=3), B: signals()})
    assert got[A][0] == pytest.approx(MAX_WEIGHT / 9, rel=0.1)  # (1 / (1 + 3 - 1))^2
    strict = BalancingConfig(smoothing=1.0, queue_slack=0)
    assert weights({A: signals(waiting=1), B: signals()}, strict)[A][0] == pytest.approx(
        MAX_WEIGHT / 4, rel=0.1
    )


def test_a_session_pool_rings_on_capacity_while_load_moves_the_weights() -> None:
    pool = POOL.model_copy(update={"session_affinity": True})
    scored = score_pool(
        pool,
        settings=SETTINGS,
        signals={A: signals(waiting=6), B: signals(kv_capacity_tokens=40_000)},
        memory={},
    )
    a, b = scored.state.endpoints
    assert a.weight < b.weight  # A queues: its weight falls...
    # ... but its share of the ring stays what its capacity (KV size, 4th power) says.
    assert (a.ring_weight, b.ring_weight) == (MAX_WEIGHT, round(MAX_WEIGHT / 1.15**20))
    plain = score_pool(POOL, settings=SETTINGS, signals={A: signals(), B: signals()}, memory={})
    assert all(e.ring_weight is None for e in plain.state.endpoints)
    # Endpoint names carry through to the ring (what Envoy hashes), addresses otherwise.
    named = pool.model_copy(
        update={"endpoints": (pool.endpoints[0].model_copy(update={"name": "ml/a"}),)}
    )
    (only,) = score_pool(
        named, settings=SETTINGS, signals={A: signals()}, memory={}
    ).state.endpoints
    assert (only.name, only.ring_key) == ("ml/a", "ml/a")
    assert b.ring_key == b.id


def test_an_adapter_running_somewhere_grows_active_and_one_running_nowhere_fades() -> None:
    pool_signals = {
        A: signals(adapters=("a",), running_adapters=("a",), max_adapters=2),
        B: signals(adapters=("b",), running_adapters=(), max_adapters=2),
    }
    activity: Mapping[str, float] = {"b": 0.5}
    for _ in range(3):
        activity = score_pool(
            LORA_POOL,
            settings=SETTINGS,
            signals=pool_signals,
            memory={},
            adapter_activity=activity,
        ).adapter_activity
    # a runs in A: up from 0; b only waits in B: down from 0.5; c runs nowhere: stays 0.
    assert 0 < activity["a"] < 1 and 0 < activity["b"] < 0.5 and activity["c"] == 0
    # New pods that have run nothing: the activity seen on the old ones is forgotten.
    fresh = {key: signals(max_adapters=2) for key in (A, B)}
    forgotten = score_pool(
        LORA_POOL, settings=SETTINGS, signals=fresh, memory={}, adapter_activity=activity
    ).adapter_activity
    assert forgotten == {"a": 0.0, "b": 0.0, "c": 0.0}


def _spilled(pool_signals: dict[str, PodSignals], **kw: object) -> set[str]:
    session_pool = POOL.model_copy(update={"session_affinity": True, **kw.pop("pool", {})})
    scored = score_pool(session_pool, settings=SETTINGS, signals=pool_signals, memory={}, **kw)  # type: ignore[arg-type]
    return {e.id for e in scored.state.endpoints if e.spilling}


def test_a_queueing_pod_spills_its_keys_off_the_session_ring() -> None:
    """Queueing beyond the slack (1 waiting) plus twice the other pods' median queue, or
    holding a long prefill: its keys go to other pods until it recovers. A surge that
    every pod queues through moves no key."""
    assert _spilled({A: signals(waiting=3), B: signals()}) == {A}
    assert _spilled({A: signals(waiting=1), B: signals()}) == set()  # the slack
    assert _spilled({A: signals(), B: signals()}, long_prompts={B: 1}) == {B}
    assert _spilled({A: signals(waiting=12), B: signals(waiting=4)}) == {A}  # 12 > 1 + 2 x 4
    assert _spilled({A: signals(waiting=8), B: signals(waiting=4)}) == set()  # a surge
    assert _spilled({A: signals(waiting=3), B: signals(waiting=5)}) == set()
    # Only session pools have a ring.
    scored = score_pool(POOL, settings=SETTINGS, signals={A: signals(waiting=3)}, memory={})
    assert not any(e.spilling for e in scored.state.endpoints)


# The batch limit of the session pool below, and the batches at which its rules start
# (Tuning: spill_full, spill_release, spill_ahead_full of the limit).
LIMIT = 48
TUNING = Tuning()
FULL_AT = math.ceil(TUNING.spill_full * LIMIT)
RELEASE_AT = math.ceil(TUNING.spill_release * LIMIT)
AHEAD_AT = math.ceil(TUNING.spill_ahead_full * LIMIT)


def _session_step(
    pool_signals: dict[str, PodSignals], previous: ScoredPool | None = None, limit: int = LIMIT
) -> ScoredPool:
    """One decision of a session-affinity pool whose engines run `limit` requests at most,
    fed the previous one's memory."""
    session_pool = POOL.model_copy(update={"session_affinity": True, "batch_limit": limit})
    return score_pool(
        session_pool,
        settings=SETTINGS,
        signals=pool_signals,
        memory=previous.memory if previous else {},
        spilled=previous.spilled if previous else frozenset(),
    )


def _weight(scored: ScoredPool, key: str) -> int:
    return next(e.weight for e in scored.state.endpoints if e.id == key)


def test_a_full_batch_spills_before_it_queues_and_holds_until_it_has_room() -> None:
    """From `spill_full` of the pool's batch limit (vLLM's max_num_seqs, which no metric
    reports) a pod spills its keys and leaves the pool cluster's rotation while the other
    pods queue nothing, and takes them back only once its batch is below `spill_release`
    of the limit."""
    calm = signals(running=RELEASE_AT + 1)
    assert _session_step({A: signals(running=FULL_AT - 1), B: calm}).spilled == frozenset()
    full = _session_step({A: signals(running=FULL_AT), B: calm})
    assert full.spilled == {A}
    spilled_for = next(e for e in full.state.endpoints if e.id == A).reasons
    assert spilled_for[0].code == "spill_batch_full", spilled_for
    assert _weight(full, A) < _weight(full, B) / 50
    # Still full with one waiting, then at the release point: held (released at its first
    # short queue before, it took its keys back with no free slot and queued again).
    held = _session_step({A: signals(running=LIMIT, waiting=1), B: calm}, full)
    held = _session_step({A: signals(running=RELEASE_AT), B: calm}, held)
    assert held.spilled == {A}
    assert next(e for e in held.state.endpoints if e.id == A).reasons[0].code == "spill_held"
    released = _session_step({A: signals(running=RELEASE_AT - 1), B: calm}, held)
    assert released.spilled == frozenset()
    assert _weight(released, A) == _weight(released, B)


def test_a_pod_clearly_ahead_of_the_others_spills_from_spill_ahead_full() -> None:
    """A hot key's pod, at `spill_ahead` times the other pods' median batch, spills from
    `spill_ahead_full` of the limit; a pod as busy as the others waits for `spill_full`."""
    behind = math.floor(AHEAD_AT / TUNING.spill_ahead)  # A is ahead of it
    others = signals(running=behind)
    assert _session_step({A: signals(running=AHEAD_AT - 1), B: others}).spilled == frozenset()
    ahead = _session_step({A: signals(running=AHEAD_AT), B: others})
    assert ahead.spilled == {A}
    assert ahead.state.endpoints[0].reasons[0].code == "spill_batch_ahead"
    level = signals(running=math.floor(AHEAD_AT / TUNING.spill_ahead) + 1)  # not ahead
    assert _session_step({A: signals(running=AHEAD_AT), B: level}).spilled == frozenset()
    queuing = signals(running=10, waiting=3)  # the others queue: a surge, not a lead
    assert A not in _session_step({A: signals(running=FULL_AT - 2), B: queuing}).spilled
    cached = signals(running=FULL_AT - 2, prefix_hit_rate=TUNING.spill_max_hit_rate)
    assert _session_step({A: cached, B: others}).spilled == frozenset()


def test_without_a_batch_limit_only_queues_move_keys() -> None:
    """A limit guessed from queues was wrong: vLLM also queues when prefills use up a
    step's token budget, with free slots."""
    session_pool = POOL.model_copy(update={"session_affinity": True})
    full = {A: signals(running=48, waiting=1), B: signals(running=10)}
    scored = score_pool(session_pool, settings=SETTINGS, signals=full, memory={})
    assert scored.spilled == frozenset()


def test_a_full_pod_whose_cache_serves_half_its_prompts_keeps_its_keys() -> None:
    """Moving keys whose prefixes are cached costs more prefill than a slot's wait."""
    calm = signals(running=10)
    below = TUNING.spill_max_hit_rate - 0.01
    assert _session_step({A: signals(running=FULL_AT, prefix_hit_rate=below), B: calm}).spilled == {
        A
    }
    at = TUNING.spill_max_hit_rate
    cached = _session_step({A: signals(running=FULL_AT, prefix_hit_rate=at), B: calm})
    assert cached.spilled == frozenset()


def test_a_full_pod_spilled_for_its_queue_holds_through_one_short_queue_whatever_its_cache() -> (
    None
):
    """The rule-order bug seen with a real vLLM (8 slots): a full pod spilled for its
    queue, whose prefix cache served most of its prompts, read one scrape with a single
    request waiting, and the prefix-cache exemption gave its keys back for that scrape
    (a keyed request sent then waited 2 s). A pod with no free slot now holds the spill
    before the exemption is asked; it takes its keys back once a slot is free."""
    limit = 8
    calm = signals(running=2)
    queued = {A: signals(running=8, waiting=5, prefix_hit_rate=0.8), B: calm}
    spilled = _session_step(queued, limit=limit)
    assert spilled.spilled == {A}
    assert spilled.state.endpoints[0].reasons[0].code == "spill_queue"
    short_queue = {A: signals(running=8, waiting=1, prefix_hit_rate=0.8), B: calm}
    held = _session_step(short_queue, spilled, limit=limit)
    assert held.spilled == {A}
    assert held.state.endpoints[0].reasons[0].code == "spill_held"
    full = {A: signals(running=8, prefix_hit_rate=0.8), B: calm}
    held = _session_step(full, held, limit=limit)
    assert held.spilled == {A}
    with_room = {A: signals(running=limit - 1, prefix_hit_rate=0.8), B: calm}
    assert _session_step(with_room, held, limit=limit).spilled == frozenset()


def test_a_prefill_backlog_moves_cached_keys_only_once_longer_than_their_misses() -> None:
    """A queue beside a batch with room clears in a few engine steps; moving keys whose
    prefixes are cached makes each moved request prefill them again, elsewhere: at a hit
    rate of 0.8, four times what the request prefills at home."""
    calm = signals(running=8)
    cached_backlog = {A: signals(running=8, waiting=2, prefix_hit_rate=0.8), B: calm}
    assert _session_step(cached_backlog).spilled == frozenset()
    longer = {A: signals(running=8, waiting=6, prefix_hit_rate=0.8), B: calm}
    assert _session_step(longer).spilled == {A}  # 6 > 1 (slack) + 4 (0.8 / 0.2)
    uncached = {A: signals(running=8, waiting=2, prefix_hit_rate=0.3), B: calm}
    assert _session_step(uncached).spilled == {A}
    # Behind a batch at `spill_release` of the limit or more, a queue waits for decodes.
    behind_batch = {A: signals(running=RELEASE_AT, waiting=2, prefix_hit_rate=0.8), B: calm}
    assert _session_step(behind_batch).spilled == {A}
    # Even a prefix that is always cached moves once 19 requests queue behind it.
    runaway = {A: signals(running=8, waiting=21, prefix_hit_rate=1.0), B: calm}
    assert _session_step(runaway).spilled == {A}
    # Without the pool's batch limit, a backlog cannot be told from a full batch: any
    # queue beyond the slack moves keys, as before.
    assert _spilled(cached_backlog) == {A}


def test_a_full_batch_spills_only_among_calm_pods() -> None:
    """A full batch while the other pods queue too is a surge, which moves no key."""
    surge = {A: signals(running=48, waiting=1), B: signals(running=30, waiting=2)}
    assert _session_step(surge).spilled == frozenset()


def test_no_pod_spills_when_every_pod_would() -> None:
    both_full = {A: signals(running=48, waiting=3), B: signals(running=48, waiting=3)}
    first = _session_step(both_full)
    assert first.spilled == frozenset()
    assert not any(e.spilling for e in first.state.endpoints)


def test_at_most_half_the_pods_spill_the_most_loaded_first() -> None:
    """Maglev gives a spilled pod's keys to the others: with three of four out, one pod
    would take every key."""
    four = POOL.model_copy(
        update={
            "session_affinity": True,
            "batch_limit": 40,
            "endpoints": [EndpointConfig(address=f"10.0.0.{i}", port=8000) for i in range(1, 5)],
        }
    )
    pods = {
        "10.0.0.1:8000": signals(running=3),
        "10.0.0.2:8000": signals(running=38),
        "10.0.0.3:8000": signals(running=40),
        "10.0.0.4:8000": signals(running=39),
    }
    full = score_pool(four, settings=SETTINGS, signals=pods, memory={})
    assert full.spilled == {"10.0.0.3:8000", "10.0.0.4:8000"}
