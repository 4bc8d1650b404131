"""Key homes balanced by load: the session cluster's ring weights, nudged by what pods carry.

Maglev hashes each session key to a slot of a table whose slots the pods share by their
ring weights (capacity alone, weights.py). With a few dozen keys, where the hash drops them
decides the load: on scenario c, 32 prefix groups got 11/9/9/3 homes on every seed, and one
pod served 19-49 requests while the others served 50-217. The server sees no key, but it
sees what each pod carries (running plus waiting, from its metrics, keyed traffic and
unkeyed alike) and how often it spills its keys (spill.py): over a window of decisions, a
pod whose share of the pool's load is beyond its share of the ring's capacity and which
spilled its keys in `Tuning.home_spill_share` of the window gets a smaller ring weight (its
factor divided by its ratio), so that Maglev hands some of its slots, and the keys in them,
to the others.

Only a pod that spills: a key that moves loses its cached prefix, and on scenario c, whose
pods have room, moving keys by load share alone (every pod's factor divided by its ratio,
each window) evened the requests per pod (68/66/59/45 against 87/71/63/17) and cost the
moved keys their prefixes: P95 TTFT 0.51 s against 0.14 s, seeds 1-2. A pod that spills
sends its keys' requests to pods without their prefixes anyway, request after request;
moving a few of its keys for good costs one miss each.

Moves are bounded: at most once per window (`home_window_intervals` busy decisions: one
where the pods hold under `home_min_load` each on average counts for nothing and leaves
the memory as it was), only beyond `home_tolerance`, and every factor stays within
`home_max_factor` of 1. A pod that joins or leaves restarts the window (its keys move
anyway). `home_max_factor` 1 keeps the hash's homes.

Where the Envoys log the pool's session keys (hashed at once: xds/session_keys.py), the
server knows every key's home, for Maglev's table is computed here as Envoy computes it
(xds_server/maglev.py), and it places keys instead. A key that moves loses its cached
prefix, so the placement is built to move few:

- Each key weighs its recent requests plus `home_key_prior` times the mean, so that the
  noise of a key's requests does not move keys, while a key many times as busy as the
  others weighs as several.
- Keys not seen yet count too: the share of requests that will bring a new key is taken
  as the share that brought a key seen once (Good-Turing's missing mass), and it lands
  by the table's slot shares. Early on, when most keys are still to come, the slots
  matter as much as the few keys seen; once the keys are known, the keys do.
- At the end of a window, when some pod's load so reckoned is off its capacity share by
  more than `home_tolerance` plus one mean key (so that no single new key moves others),
  it steps the most loaded pod's ring weight down the weight ladder, the least loaded
  pod's up, or both (zero to `home_step_span` steps each, building the table for each),
  until the pods fall within `home_placement_target` or no step helps. Of the steps that
  reach the target, the one that moves the fewest keys; otherwise the one that evens the
  pods most. The keys that move are the ones the steps move, no more.
- Within the tolerance, a step that moves no logged key but evens the slots for the keys
  to come by `home_free_step_gain` is taken: it costs no prefix.

An offline model over 200 random pools of scenario c's shape
(bench/results/homes-few-moves/model.py) puts what the last three points buy: the moved
keys' requests after c's warm-up (each a prefix miss) fell from 1.86 a run to 1.14, and
from 5.11 to 2.04 with c@more-prefixes' 64 groups. At most `home_placement_steps` steps a
window; pools of more than `home_placed_max_pods` pods keep the rule above (a window's
search held the event loop up to 30 ms for 4 pods, 53 ms for 8, `python -m
bench.key_placement`; and many keys a pod even out by themselves).

Server replicas place the same keys: each is sent its peers' logged keys
(peering/links.py) and adds them to its own. One places for all, the replica whose name
sorts first among those up: the others take its factors as theirs (`followed_homes`), so
that every replica's Envoys send a key to the same pod.

Pure: the memory of the last call comes in, the next goes out; no clock, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from xds_server.maglev import maglev_table
from xds_server.policy.reasons import Reason
from xds_server.policy.signals import PodSignals
from xds_server.tuning import Tuning

__all__ = ["HomeMemory", "Homes", "LoggedKeys", "balanced_homes", "followed_homes"]


@dataclass(frozen=True, kw_only=True)
class HomeMemory:
    """What the homes rule remembers of a pool: each pod's ring-weight factor (1 when
    absent), its load (running plus waiting) summed over the window's `samples`
    decisions and the number of them in which it spilled, and each factor's ratio of load
    share to capacity share when it was set."""

    factors: Mapping[str, float] = field(default_factory=dict)
    load: Mapping[str, float] = field(default_factory=dict)
    spills: Mapping[str, int] = field(default_factory=dict)
    samples: int = 0
    ratios: Mapping[str, float] = field(default_factory=dict)

    def factor(self, key: str) -> float:
        return self.factors.get(key, 1.0)


@dataclass(frozen=True, kw_only=True)
class LoggedKeys:
    """A pool's session keys as its Envoys logged them, and what places them: each key's
    hash and its requests (decayed), the name Envoy hashes each endpoint by, the session
    table's size, and the ring weights the server sends for given factors (scoring.py)."""

    counts: Mapping[int, float]
    names: Mapping[str, str]
    size: int
    weights: Callable[[Mapping[str, float]], Mapping[str, int]]


@dataclass(frozen=True, kw_only=True)
class Homes:
    memory: HomeMemory
    # Why a pod's ring weight is off its capacity's (pods whose factor is not 1).
    reasons: Mapping[str, Reason]


def balanced_homes(
    healthy: Sequence[str],
    fresh: Mapping[str, PodSignals],
    capacity_shares: Mapping[str, float],
    spilling: Set[str],
    memory: HomeMemory,
    tuning: Tuning,
    keys: LoggedKeys | None = None,
) -> Homes:
    """The ring-weight factors of the pool's pods after this decision.

    `healthy`: the pods in rotation (those in the session table); `fresh`: their believed
    signals; `capacity_shares`: each pod's ring weight from capacity alone (any scale);
    `spilling`: the pods spilling their keys for load now; `memory`: the last call's;
    `keys`: the pool's logged session keys, when the Envoys log them.
    """
    present = tuple(k for k in healthy if k in fresh and capacity_shares.get(k, 0.0) > 0)
    now = sum(fresh[k].running + fresh[k].waiting for k in present)
    if not present or now < tuning.home_min_load * len(present):
        # An idle decision teaches nothing, and leaves the memory as it was: an idle pool's
        # decision stays the same, and costs nothing (decision.py's Decider).
        return Homes(memory=memory, reasons=_reasons(memory.factors, memory.ratios, present))
    factors = {k: f for k, f in memory.factors.items() if k in present}
    ratios = {k: r for k, r in memory.ratios.items() if k in factors}
    load, spills, samples = dict(memory.load), dict(memory.spills), memory.samples
    if set(load) != set(present):
        load, spills, samples = dict.fromkeys(present, 0.0), dict.fromkeys(present, 0), 0
    for key in present:
        load[key] += fresh[key].running + fresh[key].waiting
        spills[key] += key in spilling
    samples += 1
    if samples >= tuning.home_window_intervals:
        moved = _moved(
            present, load, spills, samples, capacity_shares, factors, keys, spilling, tuning
        )
        if moved is not None:
            factors, moved_ratios = moved
            ratios = {k: r for k, r in ratios.items() if k in factors} | moved_ratios
        load, spills, samples = dict.fromkeys(present, 0.0), dict.fromkeys(present, 0), 0
    kept = HomeMemory(factors=factors, load=load, spills=spills, samples=samples, ratios=ratios)
    return Homes(memory=kept, reasons=_reasons(factors, ratios, present))


def followed_homes(healthy: Sequence[str], factors: Mapping[str, float]) -> Homes:
    """The key homes of the replica this one follows (its ring-weight `factors`, by
    endpoint id), taken as they are: this replica places nothing of its own, so that
    every replica's Envoys send a key to the same pod."""
    kept = {k: f for k, f in factors.items() if k in healthy and f != 1.0}
    return Homes(memory=HomeMemory(factors=kept), reasons=_reasons(kept, {}, healthy))


def _moved(
    present: Sequence[str],
    load: Mapping[str, float],
    spills: Mapping[str, int],
    samples: int,
    capacity_shares: Mapping[str, float],
    factors: Mapping[str, float],
    keys: LoggedKeys | None,
    spilling: Set[str],
    tuning: Tuning,
) -> tuple[dict[str, float], dict[str, float]] | None:
    """A window's move: the logged keys placed, where there are enough of them in a small
    enough pool (not while a pod spills: a spill is a moment's, a placement for good; and
    with `spill_to: ring` a spilling pod is out of the table); else the spill rule."""
    if keys is not None and len(keys.counts) >= len(present):
        if len(present) <= tuning.home_placed_max_pods:
            return None if spilling else _placed(present, keys, capacity_shares, factors, tuning)
    return _rebalanced(present, load, spills, samples, capacity_shares, factors, tuning)


def _rebalanced(
    present: Sequence[str],
    load: Mapping[str, float],
    spills: Mapping[str, int],
    samples: int,
    capacity_shares: Mapping[str, float],
    factors: Mapping[str, float],
    tuning: Tuning,
) -> tuple[dict[str, float], dict[str, float]] | None:
    """New factors, and the ratios of the pods that moved, when the window shows a busy
    pool with a pod beyond its share by more than the tolerance that spilled in enough of
    it; None otherwise."""
    total = sum(load[k] for k in present)
    if len(present) < 2 or total < tuning.home_min_load * len(present) * samples:
        return None
    capacity = sum(capacity_shares[k] for k in present)
    ratios = {k: (load[k] / total) / (capacity_shares[k] / capacity) for k in present}
    movers = [
        k
        for k in present
        if ratios[k] > 1 + tuning.home_tolerance
        and spills[k] >= tuning.home_spill_share * samples
        and factors.get(k, 1.0) > 1 / tuning.home_max_factor
    ]
    if not movers:
        return None
    moved = dict(factors)
    for key in movers:
        moved[key] = max(1 / tuning.home_max_factor, moved.get(key, 1.0) / ratios[key])
    kept = {k: f for k, f in moved.items() if f != 1.0}
    return kept, {k: ratios[k] for k in movers}


@dataclass(frozen=True)
class _Trial:
    """Factors tried when placing keys: how spread they leave the load of the keys seen
    and to come over the pods (capacity-weighted squared deviations), how many logged keys
    move, and each pod's ratio of that load to its capacity share."""

    spread: float
    moved: int
    factors: dict[str, float]
    ratios: dict[str, float]


class _KeyPlacement:
    """Where a pool's logged keys go under given factors, and the search for better ones
    (the module docstring). Built per window; holds the targets and key weights."""

    def __init__(
        self,
        present: Sequence[str],
        keys: LoggedKeys,
        capacity_shares: Mapping[str, float],
        tuning: Tuning,
    ) -> None:
        self._present = present
        self._keys = keys
        capacity = sum(capacity_shares[k] for k in present)
        self._target = {k: capacity_shares[k] / capacity for k in present}
        requests = sum(keys.counts.values())
        prior = tuning.home_key_prior * requests / len(keys.counts)
        self._weight = {h: c + prior for h, c in keys.counts.items()}
        self._total = sum(self._weight.values())
        self._by_name = {keys.names[k]: k for k in present}
        self._start_homes: dict[int, str] = {}
        # Good-Turing: the next request brings a new key as often as the requests so far
        # brought a key seen once (its count, decayed, under `home_seen_once_count`).
        once = sum(1 for c in keys.counts.values() if c < tuning.home_seen_once_count)
        self.unseen = min(1.0, once / requests) if requests > 0 else 1.0
        # One mean key's share of the smallest pod's: how far one new key moves a pod.
        self.grain = (1 - self.unseen) / len(keys.counts) / min(self._target.values())

    def trial(self, factors: Mapping[str, float]) -> _Trial:
        sent = self._keys.weights(factors)
        table = maglev_table({self._keys.names[k]: sent[k] for k in self._present}, self._keys.size)
        homes = {h: self._by_name[table.host_of(h)] for h in self._weight}
        slots = table.shares()
        ratios = {
            k: self.unseen * slots[self._keys.names[k]] / self._target[k] for k in self._present
        }
        seen = 1 - self.unseen
        for h, w in self._weight.items():
            ratios[homes[h]] += seen * w / self._total / self._target[homes[h]]
        if not self._start_homes:
            self._start_homes = homes
        moved = sum(1 for h in self._weight if homes[h] != self._start_homes[h])
        # What a step must lower: any key that moves from a pod above its share to one below
        # lowers it, where the largest deviation may stay as it was for a while.
        spread = sum(self._target[k] * (r - 1) ** 2 for k, r in ratios.items())
        return _Trial(spread, moved, dict(factors), ratios)

    def steps(self, current: _Trial, tuning: Tuning) -> list[_Trial]:
        """The trials of one step from `current`: the most loaded pod's factor down and the
        least loaded's up, 0 to `home_step_span` ladder steps each."""
        over = max(self._present, key=lambda k: current.ratios[k])
        under = min(self._present, key=lambda k: current.ratios[k])
        bound, ladder = tuning.home_max_factor, tuning.weight_ladder
        span = range(round(tuning.home_step_span) + 1)
        trials = []
        for down, up in itertools.product(span, span):
            factors = dict(current.factors)
            factors[over] = max(1 / bound, factors.get(over, 1.0) / ladder**down)
            factors[under] = min(bound, factors.get(under, 1.0) * ladder**up)
            if factors != current.factors:
                trials.append(self.trial(factors))
        return trials


def _placed(
    in_rotation: Sequence[str],
    keys: LoggedKeys,
    capacity_shares: Mapping[str, float],
    factors: Mapping[str, float],
    tuning: Tuning,
) -> tuple[dict[str, float], dict[str, float]] | None:
    """New factors, and the key-load ratios of the pods whose factor moved, when the keys'
    homes in Envoy's table are off the capacity shares by more than the tolerance (plus a
    key) and a few ladder steps bring them closer, or when a step that moves no key evens
    the slots; None otherwise."""
    placement = _KeyPlacement(in_rotation, keys, capacity_shares, tuning)
    start = current = placement.trial(factors)
    if _off(start) <= tuning.home_tolerance + placement.grain:
        return _free_step(placement, start, tuning)
    for _ in range(round(tuning.home_placement_steps)):
        trials = placement.steps(current, tuning)
        done = [t for t in trials if _off(t) <= tuning.home_placement_target]
        best = min(done, key=lambda t: (t.moved, t.spread), default=None) or min(
            trials, key=lambda t: (t.spread, t.moved), default=None
        )
        if best is None or best.spread >= current.spread:
            break
        current = best
        if _off(current) <= tuning.home_placement_target:
            break
    if current.spread >= start.spread:
        return None
    kept = {k: f for k, f in current.factors.items() if f != 1.0}
    changed = {
        k: start.ratios[k]
        for k in in_rotation
        if current.factors.get(k, 1.0) != factors.get(k, 1.0)
    }
    return kept, changed


def _free_step(
    placement: _KeyPlacement, start: _Trial, tuning: Tuning
) -> tuple[dict[str, float], dict[str, float]] | None:
    """The step that moves no logged key and evens the slots (where the keys to come land)
    the most, when it lowers the spread by `home_free_step_gain`; None otherwise."""
    free = [
        t
        for t in placement.steps(start, tuning)
        if t.moved == 0 and t.spread < start.spread * (1 - tuning.home_free_step_gain)
    ]
    best = min(free, key=lambda t: t.spread, default=None)
    if best is None:
        return None
    return {k: f for k, f in best.factors.items() if f != 1.0}, {}


def _off(trial: _Trial) -> float:
    """The largest deviation of a pod's key load from its capacity share."""
    return max(abs(r - 1) for r in trial.ratios.values())


def _reasons(
    factors: Mapping[str, float], ratios: Mapping[str, float], present: Sequence[str]
) -> dict[str, Reason]:
    reasons = {}
    for key, factor in factors.items():
        if key in present:
            ratio = ratios.get(key)
            seen = f": its keys brought it {ratio:.2f}x its capacity share" if ratio else ""
            detail = f"ring weight x{factor:.2f}{seen}"
            reasons[key] = Reason("home_share", detail)
    return reasons
