"""Key homes balanced by load (xds_server/policy/homes.py): the ring-weight factors."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import pytest

from xds_server.config import BalancingConfig, PoolConfig
from xds_server.maglev import key_hash, maglev_table, table_size
from xds_server.policy.homes import HomeMemory, LoggedKeys, balanced_homes, followed_homes
from xds_server.policy.scoring import score_pool
from xds_server.policy.signals import PodSignals
from xds_server.policy.weights import MAX_WEIGHT, quantize
from xds_server.tuning import Tuning

TUNING = Tuning()
WINDOW = int(TUNING.home_window_intervals)
PODS = ("a", "b", "c", "d")
EQUAL = dict.fromkeys(PODS, 1.0)


def _signals(load: dict[str, float]) -> dict[str, PodSignals]:
    return {k: PodSignals(silent_s=0.0, waiting=0.0, running=v) for k, v in load.items()}


def _run(
    load: dict[str, float],
    decisions: int,
    memory: HomeMemory | None = None,
    tuning: Tuning = TUNING,
    shares: dict[str, float] = EQUAL,
    spilling: frozenset[str] = frozenset({"a"}),
) -> HomeMemory:
    """`decisions` decisions with `load` per pod, the pods of `spilling` spilling in each."""
    memory = memory or HomeMemory()
    for _ in range(decisions):
        homes = balanced_homes(tuple(load), _signals(load), shares, spilling, memory, tuning)
        memory = homes.memory
    return memory


def test_a_pool_whose_load_follows_capacity_keeps_the_hash_homes() -> None:
    memory = _run({"a": 10, "b": 11, "c": 9, "d": 10}, 3 * WINDOW)
    assert memory.factors == {}


def test_a_spilling_pod_carrying_twice_its_share_gets_a_smaller_ring_weight_per_window() -> None:
    load = {"a": 20.0, "b": 7.0, "c": 7.0, "d": 6.0}
    before = _run(load, WINDOW - 1)
    assert before.factors == {}, "nothing moves before a whole window"
    after = _run(load, 1, before)
    # a carries 20 of 40 where its capacity share is a quarter: ratio 2, factor 1/2; the
    # others keep theirs (Maglev hands a's slots to them).
    assert after.factors == pytest.approx({"a": 0.5})
    assert after.ratios["a"] == pytest.approx(2.0)
    # The next window starts empty: the same load moves nothing until it is over.
    assert _run(load, WINDOW - 1, after).factors == after.factors
    assert _run(load, WINDOW, after).factors["a"] == pytest.approx(0.25)


def test_a_loaded_pod_that_does_not_spill_keeps_its_keys() -> None:
    """Scenario c: pods with room serve their keys' prefixes from cache; moving keys for
    load share alone cost more prefill than the evener load saved."""
    load = {"a": 20.0, "b": 7.0, "c": 7.0, "d": 6.0}
    assert _run(load, 3 * WINDOW, spilling=frozenset()).factors == {}


def test_a_pod_that_spilled_in_too_little_of_the_window_keeps_its_keys() -> None:
    load = {"a": 20.0, "b": 7.0, "c": 7.0, "d": 6.0}
    spilled_for = int(TUNING.home_spill_share * WINDOW) - 1
    memory = _run(load, spilled_for)
    memory = _run(load, WINDOW - spilled_for, memory, spilling=frozenset())
    assert memory.samples == 0 and memory.factors == {}


def test_an_idle_pool_moves_no_key() -> None:
    idle = {"a": 0.9, "b": 0.0, "c": 0.1, "d": 0.0}  # below home_min_load per pod
    assert _run(idle, 2 * WINDOW).factors == {}


def test_an_idle_decision_leaves_the_memory_as_it_was() -> None:
    """So an idle pool's decision is the same as the last one, and costs nothing."""
    memory = _run({"a": 20.0, "b": 7.0, "c": 7.0, "d": 6.0}, 5)
    idle = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0}
    after = balanced_homes(tuple(idle), _signals(idle), EQUAL, frozenset(), memory, TUNING)
    assert after.memory is memory and memory.samples == 5


def test_a_factor_keeps_the_ratio_it_was_set_at() -> None:
    moved = _run({"a": 20.0, "b": 7.0, "c": 7.0, "d": 6.0}, WINDOW)
    assert moved.ratios == pytest.approx({"a": 2.0})
    # Next window, b spills at 2.5 times its share; a, now carrying little, keeps its ratio.
    later = _run({"a": 2.0, "b": 25.0, "c": 7.0, "d": 6.0}, WINDOW, moved, spilling=frozenset("b"))
    assert later.factors == pytest.approx({"a": 0.5, "b": 1 / 2.5})
    assert later.ratios == pytest.approx({"a": 2.0, "b": 2.5})


def test_a_share_within_the_tolerance_moves_nothing() -> None:
    edge = 1 + TUNING.home_tolerance
    load = {"a": 10 * edge, "b": 10.0, "c": 10.0, "d": 10.0}
    total = sum(load.values())
    assert load["a"] / total * 4 <= edge  # a's ratio, inside the band
    assert _run(load, WINDOW).factors == {}


def test_factors_stay_within_the_bound() -> None:
    load = {"a": 100.0, "b": 0.0, "c": 0.0, "d": 0.0}
    memory = _run(load, 5 * WINDOW)
    assert memory.factors == pytest.approx({"a": 1 / TUNING.home_max_factor})


def test_a_bound_of_one_keeps_the_hash_homes() -> None:
    fixed = TUNING.with_overrides({"home_max_factor": 1.0})
    assert _run({"a": 30.0, "b": 1.0, "c": 1.0, "d": 1.0}, 2 * WINDOW, tuning=fixed).factors == {}


def test_shares_are_of_capacity() -> None:
    """A pod twice as large carrying twice the load is where it should be."""
    shares = {"a": 2.0, "b": 1.0, "c": 1.0}
    load = {"a": 20.0, "b": 10.0, "c": 10.0}
    assert _run(load, WINDOW, shares=shares).factors == {}


def test_a_pod_that_leaves_restarts_the_window_and_takes_its_factor_along() -> None:
    load = {"a": 20.0, "b": 7.0, "c": 7.0, "d": 6.0}
    moved = _run(load, WINDOW)
    assert "a" in moved.factors
    three = {"b": 7.0, "c": 7.0, "d": 6.0}
    after = balanced_homes(tuple(three), _signals(three), EQUAL, frozenset(), moved, TUNING).memory
    assert "a" not in after.factors and after.samples == 1
    assert set(after.load) == set(three)


def _pool(session_affinity: bool) -> PoolConfig:
    return PoolConfig.model_validate(
        {
            "name": "p",
            "models": ["m"],
            "session_affinity": session_affinity,
            "endpoints": [{"address": "10.0.0.1", "port": 8000 + i} for i in range(4)],
        }
    )


def test_score_pool_moves_the_loaded_pods_ring_weight_and_says_why() -> None:
    pool = _pool(True)
    settings = BalancingConfig(key_homes="hash")
    # The first pod queues beyond the others (it spills: spill.py) and holds 26 of 46.
    load = [(20.0, 6.0), (7.0, 0.0), (7.0, 0.0), (6.0, 0.0)]
    signals = {
        f"10.0.0.1:{8000 + i}": PodSignals(silent_s=0.0, waiting=waiting, running=running)
        for i, (running, waiting) in enumerate(load)
    }
    homes, memory, scored = HomeMemory(), {}, None
    for _ in range(WINDOW):
        scored = score_pool(pool, settings=settings, signals=signals, memory=memory, homes=homes)
        homes, memory = scored.homes, scored.memory
    assert scored is not None
    rings = {e.port: e.ring_weight for e in scored.state.endpoints}
    assert rings[8000] is not None and rings[8003] is not None
    assert rings[8000] < rings[8001] == rings[8002] == rings[8003]
    loaded = scored.state.endpoints[0]
    assert loaded.spilling
    assert [r.code for r in loaded.reasons if r.code == "home_share"] == ["home_share"]
    # 26 of 46 against a quarter: ratio 2.26, factor 0.44.
    assert "x0.44" in next(r.detail for r in loaded.reasons if r.code == "home_share")
    unkeyed = score_pool(_pool(False), settings=settings, signals=signals, memory={}, homes=homes)
    assert all(e.ring_weight is None for e in unkeyed.state.endpoints)
    assert unkeyed.homes == HomeMemory()


def _logged_keys(keys: dict[int, float], pods: tuple[str, ...] = PODS) -> LoggedKeys:
    def weights(factors: Mapping[str, float]) -> dict[str, int]:
        top = max(factors.get(k, 1.0) for k in pods)
        return {
            k: quantize(MAX_WEIGHT * factors.get(k, 1.0) / top, TUNING.weight_ladder) for k in pods
        }

    return LoggedKeys(
        counts=keys, names={k: f"ns/pod-{k}" for k in pods}, size=table_size(4), weights=weights
    )


def _key_counts(memory: HomeMemory, keys: LoggedKeys) -> dict[str, int]:
    sent = keys.weights(memory.factors)
    table = maglev_table({keys.names[k]: w for k, w in sent.items()}, keys.size)
    homes = Counter(table.host_of(h) for h in keys.counts)
    return {k: homes[keys.names[k]] for k in PODS}


def _placed_run(keys: LoggedKeys, decisions: int, memory: HomeMemory | None = None) -> HomeMemory:
    memory = memory or HomeMemory()
    load = {"a": 5.0, "b": 5.0, "c": 5.0, "d": 5.0}
    for _ in range(decisions):
        memory = balanced_homes(
            PODS, _signals(load), EQUAL, frozenset(), memory, TUNING, keys
        ).memory
    return memory


# 32 keys seen three times each (none seen once: no key is still to come), hashed as Envoy
# hashes them. Maglev's luck gives these 4/6/7/15 homes, the next set 6/8/9/9.
C_KEYS = {key_hash(f"prefix-{i}"): 3.0 for i in range(32)}
NEAR_KEYS = {key_hash(f"group-{i}"): 3.0 for i in range(32)}


def test_logged_keys_are_placed_within_the_tolerance_in_a_window() -> None:
    keys = _logged_keys(C_KEYS)
    assert sorted(_key_counts(HomeMemory(), keys).values()) == [4, 6, 7, 15]
    memory = _placed_run(keys, WINDOW)
    after = _key_counts(memory, keys)
    assert sum(after.values()) == 32
    assert all(abs(n / 8 - 1) <= TUNING.home_tolerance for n in after.values()), after
    assert memory.factors and all(
        1 / TUNING.home_max_factor <= f <= TUNING.home_max_factor for f in memory.factors.values()
    )
    # Placed, they stay: the next windows move nothing, whatever the pods' load.
    assert _placed_run(keys, 3 * WINDOW, memory).factors == memory.factors


def test_a_pod_off_by_one_key_more_than_the_tolerance_keeps_its_keys() -> None:
    """6/8/9/9: the pod with 6 is 25% under its share, beyond the tolerance (20%) by less
    than one key (12.5%). A new key landing on a pod within the tolerance takes it no
    further than that, so no single new key moves others."""
    keys = _logged_keys(NEAR_KEYS)
    assert sorted(_key_counts(HomeMemory(), keys).values()) == [6, 8, 9, 9]
    assert _placed_run(keys, 3 * WINDOW).factors == {}


def test_placing_moves_few_keys() -> None:
    keys = _logged_keys(C_KEYS)
    table = {
        k: maglev_table({keys.names[p]: w for p, w in keys.weights(f).items()}, keys.size)
        for k, f in (("before", {}), ("after", dict(_placed_run(keys, WINDOW).factors)))
    }
    moved = sum(table["before"].host_of(h) != table["after"].host_of(h) for h in C_KEYS)
    # 4/6/7/15 to within 20% of 8 each: at least 7 keys must leave the pod with 15 (to 8),
    # and 3 arrive at the pod with 4 (to 7); a few more move with the slots.
    assert 7 <= moved <= 12, moved


def test_while_most_keys_are_still_to_come_the_slots_count_as_much_as_the_keys() -> None:
    """Every key seen once: by Good-Turing nearly every next request brings a new key, and
    new keys land by the slots, which are even: the 4/6/7/15 of the keys seen so far moves
    none of them. Seen three times each, the same keys are placed (the test above)."""
    keys = _logged_keys(dict.fromkeys(C_KEYS, 1.0))
    assert _placed_run(keys, 3 * WINDOW).factors == {}


def test_a_step_that_moves_no_key_evens_the_slots_for_the_keys_to_come() -> None:
    """Pools whose ring weights a past placement left skewed (one pod's cut four ladder
    steps), with a quarter of the requests bringing new keys: where a step within the
    tolerance moves no logged key and evens the load of the keys seen and to come, it is
    taken. Such a step moves no logged key, and it gives slots (where new keys land) to
    the pods whose keys are below their share, taking them from those above."""
    skewed = {"a": TUNING.weight_ladder**-4}
    taken = 0
    for pool in range(40):
        # Half the keys seen once, half three times: 16 of 64 requests brought a new key.
        counts = {key_hash(f"pool-{pool}-{i}"): 1.0 + 2.0 * (i % 2) for i in range(32)}
        keys = _logged_keys(counts)
        before = maglev_table(
            {keys.names[p]: w for p, w in keys.weights(skewed).items()}, keys.size
        )
        start = HomeMemory(factors=skewed)
        memory = _placed_run(keys, WINDOW, start)
        if memory.factors == skewed:
            continue
        after = maglev_table(
            {keys.names[p]: w for p, w in keys.weights(memory.factors).items()}, keys.size
        )
        moved = [h for h in counts if before.host_of(h) != after.host_of(h)]
        if moved:
            # Beyond the tolerance: a placement, which moves keys to even them.
            continue
        taken += 1
        # Each key weighs its count plus three times the mean (home_key_prior).
        weight = {h: c + TUNING.home_key_prior * 2.0 for h, c in counts.items()}
        share: dict[str, float] = dict.fromkeys(keys.names.values(), 0.0)
        for h, w in weight.items():
            share[after.host_of(h)] += w / sum(weight.values())
        gained = {p: after.shares()[p] - before.shares()[p] for p in share}
        assert sum(gained[p] * (0.25 - share[p]) for p in share) > 0, (pool, gained, share)
    assert taken >= 2, taken


def test_a_heavy_key_counts_for_more_but_not_for_its_count_alone() -> None:
    """Each key is weighed by its requests plus the mean: one key with 20 times the others'
    requests weighs about 10 of them, and its pod gets fewer other keys."""
    counts = dict(C_KEYS)
    heavy = next(iter(counts))
    counts[heavy] = 60.0
    keys = _logged_keys(counts)
    memory = _placed_run(keys, WINDOW)
    sent = keys.weights(memory.factors)
    table = maglev_table({keys.names[k]: w for k, w in sent.items()}, keys.size)
    home = table.host_of(heavy)
    others = Counter(table.host_of(h) for h in counts if h != heavy)
    assert others[home] < min(n for name, n in others.items() if name != home)


def test_balanced_keys_move_nothing_and_too_few_keys_keep_the_spill_rule() -> None:
    keys = _logged_keys(C_KEYS)
    placed = _placed_run(keys, WINDOW)
    assert _placed_run(keys, WINDOW, placed).factors == placed.factors
    few = _logged_keys({key_hash("only"): 1.0, key_hash("two"): 1.0})
    assert _placed_run(few, 2 * WINDOW).factors == {}  # no pod spills: the spill rule keeps all


def test_score_pool_places_logged_keys_only_where_spills_keep_the_table() -> None:
    """With `spill_to: pool` a spilling pod keeps its slots, and the logged keys are placed
    (here 4/6/7/15 over the pool's four pods); with `ring` it leaves the table, whose
    size is then Envoy's own (maglev.py), and the keys keep the hash's homes."""
    pool = _pool(True)
    busy = {
        f"10.0.0.1:{8000 + i}": PodSignals(silent_s=0.0, waiting=0.0, running=5.0)
        for i in range(4)
    }
    names = {f"10.0.0.1:{8000 + i}": f"10.0.0.1:{8000 + i}" for i in range(4)}
    table = maglev_table(dict.fromkeys(names.values(), MAX_WEIGHT), table_size(4))
    counts: Counter[str] = Counter()
    keys: dict[int, float] = {}
    for i in range(10_000):
        hashed = key_hash(f"key-{i}")
        host = table.host_of(hashed)
        if counts[host] < (15, 7, 6, 4)[sorted(names.values()).index(host)]:
            counts[host] += 1
            keys[hashed] = 3.0
    assert len(keys) == 32
    for spill_to, placed in (("pool", True), ("ring", False)):
        settings = BalancingConfig(spill_to=spill_to, key_homes="hash")
        homes, memory = HomeMemory(), {}
        for _ in range(WINDOW):
            scored = score_pool(
                pool, settings=settings, signals=busy, memory=memory, homes=homes,
                session_keys=keys,
            )  # fmt: skip
            homes, memory = scored.homes, scored.memory
        assert bool(homes.factors) is placed, (spill_to, homes)


def test_followed_homes_are_taken_as_they_are_for_the_pods_in_rotation() -> None:
    """A replica that follows another takes its factors (homes.followed_homes): for the
    pods it has in rotation, with the reason, and it places nothing of its own."""
    homes = followed_homes(("a", "b", "c"), {"a": 0.5, "b": 1.0, "gone": 2.0})
    assert homes.memory.factors == {"a": 0.5}
    assert set(homes.reasons) == {"a"} and homes.reasons["a"].code == "home_share"
