"""LoRA adapter placement: which adapters each pod advertises (its Envoy subsets).

A pod runs at most `slots` adapters at once (vLLM's `max_loras`); a request whose adapter
finds the slots taken waits until every request of one of them has finished. So where an
adapter is advertised decides where it loads, and an adapter advertised on a pod whose
slots are in use waits there. The placement keeps three things true, and changes only
when one of them breaks, since every change costs an adapter load and a burst of waits:

1. Every adapter is advertised somewhere: on the pod with the most free slots (then the
   best score); with no free slot anywhere, in place of an adapter that other pods
   advertise too, none of them with requests waiting (its requests go there), else beyond
   the slots of the least loaded pod (it loads there when one of that pod's adapters
   drains). An adapter waiting beyond a pod's slots moves when a slot frees elsewhere.
2. A hot adapter, one whose requests wait in every advertiser although it is loaded there
   (the pods are full, not short of a slot) and whose demand per advertiser is at least a
   pod's mean load (a burst on a warm adapter is not enough), gets one more pod: a free
   slot, else, of the pods with room by their smoothed scores and within their slots, the
   one with the coldest adapter gives it up if it is colder: of a pod's adapters, the least
   demand, near-equal ones (`Tuning.adapter_demand_step`) by the config's order, the one
   listed last; of the pods, the one whose adapter is clearly colder
   (`Tuning.adapter_clearly_colder`), else the one whose adapter is listed last. If nobody
   else has that one, it waits for a slot on another pod with room, the one whose adapters
   are listed last (they drain soonest), unless some pod is beyond its slots already (then
   only a free slot will do; none: no replica this time). One hot replica per pod and
   decision, so that two hot adapters do not meet on one pod.
3. A replica nobody needs any more, an adapter on several pods none of which has requests
   waiting, whose demand per pod is below a quarter of a pod's mean load, is dropped
   from its most loaded pod. (2 and 3 need opposite conditions: no flapping.)
4. Where the adapters outnumber the pool's slots (a crowded pool: some adapter always
   waits beyond a pod's slots; the slots of all its pods, so that a pool short of pods
   for a while is placed by rules 1-3 as before), load share: a pod fed beyond its
   capacity's share of the pool's requests (`Tuning.adapter_share_tolerance`), with
   requests waiting, gives one adapter to a pod under its share that can load it at once
   (its requests use fewer adapters than its slots, counting adapters on their way to
   it), when the requests it holds beyond its share, each waiting at least a decision
   interval, would wait longer in all than the load (`Tuning.adapter_load_s`) stalls the
   receiver's batch. First the hottest adapter it runs that leaves the receiver below it
   (it drains off the overfed pod, and an adapter waiting there for a slot gets one: the
   requests already queued for that adapter cannot move), else an adapter waiting there
   for a slot. Only to an idle slot: a pod whose slots are in use loads a new adapter
   only once one of its own has no request left, which for an adapter with a few
   requests in flight can take longer than the trace (scenario e with 16 adapters), a
   cost no scrape tells. In a crowded pool, rule 1's adapters without a slot anywhere
   wait on the pod with the least load for its capacity, counting what this decision put
   there, then the fewest adapters per slot (at a cold start they are dealt out in turn:
   all went to the first pod by name before, and with 16 adapters on 4 pods of 2 slots
   that pod served half the requests).

Each decision applies 1, then 3, then moves adapters waiting beyond a pod's slots to free
slots, then 2, then 4. Every rule changes a bounded number of adapters (4: one per
decision); none undoes another's change while the inputs stand still.

Demand is estimated from what pods report. vLLM's `lora_requests_info` names the
adapters of the running and waiting requests but not their counts, so each pod's requests
(running and waiting) are split over its adapters by their rates, as seen over time: an
adapter's `activity` is the share of recent decisions in which some pod ran it
(scoring.py keeps it), and with requests arriving at random, a share f of time busy
means about -ln(1 - f) requests running on average. Split evenly instead, a cold adapter
sharing a pod with the hottest looked hot, got a replica and took the slot of a warmer
one; and two adapters alone on a pod always tied, so a pod gave up the first by name. The
estimate only ranks adapters (hot before cold) and spots idle replicas; with no history
(a cold start) the split is even.

Pure: the previous placement comes in, the next goes out; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from xds_server.tuning import Tuning

__all__ = ["AdapterPod", "place_adapters"]

_DEFAULT_TUNING = Tuning()


def _rungs(demands: Mapping[str, float], clearly_colder: float) -> dict[str, float]:
    """Each demand's rung on a `clearly_colder` ladder that starts at the least positive
    one: 0 under `clearly_colder` times it, 1 under its square, ...; no demand, -inf."""
    base = min((d for d in demands.values() if d > 0), default=1.0)
    return {
        key: math.floor(math.log(d / base) / math.log(clearly_colder)) if d > 0 else -math.inf
        for key, d in demands.items()
    }


def _demand_step(demand: float, step: float) -> float:
    """The rung of the `step` ladder that `demand` is on."""
    return math.floor(math.log(demand) / math.log(step)) if demand > 0 else -math.inf


@dataclass(frozen=True, kw_only=True)
class AdapterPod:
    """What placement needs of one in-rotation pod; `slots` as it reports them, or as its
    pool's other pods do while it has not yet (scoring.py)."""

    slots: int
    # Requests running and waiting; whether some wait (the pod is full, or an adapter of
    # its waits for a slot); the policy's score (higher: more room).
    load: float
    waiting: bool
    score: float
    # Adapters of its running and waiting requests, of the running ones, and those with
    # requests waiting although they run (queued for room, not for a slot).
    adapters: frozenset[str]
    running_adapters: frozenset[str]
    queued_adapters: frozenset[str]
    # The adapters it ran most recently, newest first: what its slots likely hold.
    recent_adapters: tuple[str, ...] = ()
    # Its name (config.EndpointConfig.ring_key): ties between pods fall by it, so that they
    # fall the same way whatever addresses the pods have.
    name: str = ""
    # Rule 4 (pools with more adapters than slots): its requests waiting, and its serving
    # capacity relative to the pool's others (capacity.py), which sets its share of the load.
    queued: float = 0.0
    capacity: float = 1.0


def place_adapters(
    adapters: Sequence[str],
    pods: Mapping[str, AdapterPod],
    previous: Mapping[str, tuple[str, ...]],
    activity: Mapping[str, float] = MappingProxyType({}),
    tuning: Tuning = _DEFAULT_TUNING,
    *,
    interval_s: float = 1.0,
    pool_slots: int | None = None,
) -> dict[str, tuple[str, ...]]:
    """The adapters each pod in `pods` advertises, from the `previous` placement (pods
    without one, as after a restart, start from what they ran most recently up to their
    slots, else from what they run, and what waits in them if it fits their slots; from
    nothing when the pods changed before any ran an adapter); `activity` (0 to 1, absent:
    0) breaks ties in estimated demand; `tuning` has the rules' thresholds; `interval_s`
    is the time until the next decision (rule 4 weighs a load against it); `pool_slots`
    the slots of all the pool's pods, in rotation or not (None: those of `pods`), which
    tells a crowded pool (more adapters than slots) from one short of pods for a while."""
    placement = _Placement(adapters, pods, previous, activity, tuning)
    if pool_slots is not None:
        placement.crowded = len(set(adapters)) > pool_slots
    return placement.result(interval_s)


class _Placement:
    """One placement decision (module docstring); `result()` applies the three rules."""

    def __init__(
        self,
        adapters: Sequence[str],
        pods: Mapping[str, AdapterPod],
        previous: Mapping[str, tuple[str, ...]],
        activity: Mapping[str, float],
        tuning: Tuning,
    ) -> None:
        self.pods = pods
        self.tuning = tuning
        configured = set(adapters)
        if set(previous) != set(pods) and not any(
            pod.adapters or pod.recent_adapters for pod in pods.values()
        ):
            # No pod has run an adapter yet, and the pods changed: moving one costs
            # nothing, so the placement starts afresh and depends on the pods alone, not
            # on the order in which they were first seen.
            previous = {}
        self.advertised: dict[str, set[str]] = {}
        for key, pod in pods.items():
            if key in previous:
                start = set(previous[key])
            elif pod.recent_adapters:
                # A restart: what the pod's slots likely hold, so nothing moves for it.
                start = set(pod.recent_adapters[: pod.slots]) | pod.running_adapters
            elif len(pod.adapters) <= pod.slots:
                start = set(pod.adapters)
            else:
                start = set(pod.running_adapters)
            self.advertised[key] = start & configured
        self.activity = activity
        self.demand = dict.fromkeys(adapters, 0.0)
        # Each pod's share of each adapter's demand (rule 4 moves that much load).
        self.carried: dict[str, dict[str, float]] = {key: {} for key in pods}
        for key, pod in pods.items():
            rates = {a: self._rate(a) for a in pod.adapters}
            total = sum(rates.values())
            for adapter in pod.adapters & configured:
                self.carried[key][adapter] = pod.load * rates[adapter] / total
                self.demand[adapter] += self.carried[key][adapter]
        # More adapters than the pods have slots: some always wait beyond a pod's slots,
        # and where they wait decides the pods' loads (rule 1's parking, rule 4).
        self.crowded = len(configured) > sum(pod.slots for pod in pods.values())
        # Demand parked on each pod in this decision (rule 1).
        self.parked = dict.fromkeys(pods, 0.0)
        self.mean_load = sum(p.load for p in pods.values()) / max(1, len(pods))
        self.by_score = sorted(pods, key=lambda k: (-pods[k].score, *self._named(k)))
        self.best = max((pod.score for pod in pods.values()), default=0.0)
        # Hottest first; activity, then configured order break ties (and order a cold start).
        self.by_demand = sorted(adapters, key=lambda a: self._coldness(a), reverse=True)
        self.listed = {adapter: i for i, adapter in enumerate(adapters)}
        # Pods that took a hot adapter in this decision.
        self.received: set[str] = set()

    def result(self, interval_s: float) -> dict[str, tuple[str, ...]]:
        for adapter in self.by_demand:
            if not self._holders(adapter):
                self._place(adapter)
        for adapter in self.by_demand:
            self._drop_idle_replica(adapter)
        self._move_to_free_slots()
        for adapter in self.by_demand:
            holders = self._holders(adapter)
            if (
                holders
                and all(self._queued(k, adapter) for k in holders)
                and self.demand[adapter] / len(holders) >= self.mean_load
            ):
                self._replicate(adapter)
        if self.crowded:
            self._relieve_overfed(interval_s)
        return {key: tuple(sorted(held)) for key, held in self.advertised.items()}

    def _queued(self, key: str, adapter: str) -> bool:
        pod = self.pods[key]
        return pod.waiting and adapter in pod.queued_adapters

    def _holders(self, adapter: str) -> list[str]:
        return [k for k in self.by_score if adapter in self.advertised[k]]

    def _free_slot(self, adapter: str) -> str | None:
        """The pod with the most free slots, then the best score, that lacks `adapter`."""
        return min(
            (
                k
                for k in self.by_score
                if adapter not in self.advertised[k]
                and len(self.advertised[k]) < self.pods[k].slots
            ),
            key=lambda k: len(self.advertised[k]) - self.pods[k].slots,
            default=None,
        )

    def _place(self, adapter: str) -> None:
        """Rule 1, for an adapter nobody advertises."""
        target = self._free_slot(adapter)
        if target is None:
            target = self._spare_cold_replica()
        if target is None:
            target = min(self.pods, key=self._parking if self.crowded else self._load_per_slot)
            self.parked[target] += self.demand[adapter]
        self.advertised[target].add(adapter)

    def _move_to_free_slots(self) -> None:
        """Rule 1 again, for adapters waiting beyond a pod's slots: a free slot elsewhere
        takes one, not running there first, then the hottest."""
        for key in self.by_score:
            held = self.advertised[key]
            running = self.pods[key].running_adapters
            for adapter in sorted(held, key=lambda a: (a in running, -self.demand[a], a)):
                if len(held) <= self.pods[key].slots:
                    break
                target = self._free_slot(adapter)
                if target is not None:
                    held.discard(adapter)
                    self.advertised[target].add(adapter)

    def _spare_cold_replica(self) -> str | None:
        """The best-scoring pod that gives up an adapter other pods advertise too, where no
        advertiser has requests waiting (a hot adapter's replica stays); the pod, or None."""
        for key in self.by_score:
            for other in sorted(self.advertised[key], key=lambda a: (self._coldness(a), a)):
                holders = self._holders(other)
                if len(holders) > 1 and not any(self.pods[k].waiting for k in holders):
                    self.advertised[key].discard(other)
                    return key
        return None

    def _replicate(self, adapter: str) -> None:
        """Rule 2, for an adapter whose every advertiser has requests waiting."""
        target = self._free_slot(adapter)
        if target is not None:
            self.advertised[target].add(adapter)
            self.received.add(target)
            return
        candidates = [
            key
            for key in self.by_score
            if self._has_room(key)
            and adapter not in self.advertised[key]
            # Not a pod that already waits for a slot of its own.
            and 0 < len(self.advertised[key]) <= self.pods[key].slots
        ]
        # The pod holding the coldest adapter: what it gives up may end up waiting for a
        # slot, and the coldest adapter's requests are the fewest to wait. Only a clearly
        # colder one (`Tuning.adapter_clearly_colder`) decides; nearer, the one listed last
        # in the config.
        # vLLM does not count requests per adapter, so two pods' cold adapters are told
        # apart by their pods' load of the moment: decided on those estimates (first on
        # the exact figures, then on a ladder, then with rungs counted from the least),
        # scenario e went one way in some runs of a trace and another in others
        # (bench/results/e-stability/NOTES.md). And of the pods, those with room by their
        # smoothed scores: whether one had a request waiting at that instant decided too.
        given = {key: self._coldest(key) for key in candidates}
        rungs = _rungs(
            {key: self.demand[given[key]] for key in candidates},
            self.tuning.adapter_clearly_colder,
        )
        for key in sorted(
            candidates, key=lambda k: (rungs[k], -self.listed[given[k]], *self._named(k))
        ):
            held = self.advertised[key]
            coldest = given[key]
            if self.demand[coldest] >= self.demand[adapter]:
                continue
            home = None
            if self._holders(coldest) == [key]:
                home = self._home_for_displaced(adapter, key)
                if home is None:
                    continue
            held.discard(coldest)
            held.add(adapter)
            self.received.add(key)
            if home is not None:
                self.advertised[home].add(coldest)
            return

    def _named(self, key: str) -> tuple[str, str]:
        return self.pods[key].name, key

    def _home_for_displaced(self, adapter: str, giver: str) -> str | None:
        """Where the adapter `giver` gives up to the hot `adapter` waits for a slot: of the
        other pods with room (`_has_room`), not holding `adapter` (its requests queue
        there) and none beyond its slots, the one whose adapters are listed last in the
        config (the coldest, by the configured order: they drain soonest, and a slot
        frees only when one does), then by name; only pods with a free slot while some
        pod is beyond its slots already (no replica is worth a second such wait). Not the
        least loaded, nor one without a request waiting at this instant: that chose between
        two pods by whichever had a request queued when an adapter got its replica, and
        the same trace gave different tails from run to run
        (bench/results/e-stability/NOTES.md)."""
        beyond = any(len(self.advertised[k]) > self.pods[k].slots for k in self.pods)
        unlisted = len(self.listed)
        return min(
            (
                k
                for k, pod in self.pods.items()
                if k != giver
                and self._has_room(k)
                and adapter not in self.advertised[k]
                and len(self.advertised[k]) < pod.slots + (not beyond)
            ),
            key=lambda k: (
                -max((self.listed[a] for a in self.advertised[k]), default=unlisted),
                *self._named(k),
            ),
            default=None,
        )

    def _coldest(self, key: str) -> str:
        """The adapter `key` would give up: the least demand on the `adapter_demand_step`
        ladder, and of near-equal ones the last listed in the config (the configured order
        breaks ties in `by_demand` too: listed first counts as hotter). Two adapters on one
        pod split its load by their activity, which is about 1 for both at high load, so
        their exact figures differ by noise, and which one a pod gave up changed from run
        to run of one trace (bench/results/e-stability/NOTES.md)."""
        return min(
            self.advertised[key],
            key=lambda a: (
                _demand_step(self.demand[a], self.tuning.adapter_demand_step),
                -self.listed[a],
                a,
            ),
        )

    def _rate(self, adapter: str) -> float:
        """The adapter's relative arrival rate, from its activity (module docstring)."""
        busy = min(self.activity.get(adapter, 0.0), self.tuning.max_adapter_activity)
        return self.tuning.adapter_rate_floor - math.log(1 - busy)

    def _coldness(self, adapter: str) -> tuple[float, float]:
        """Estimated demand, then activity: lower is colder."""
        return self.demand[adapter], self.activity.get(adapter, 0.0)

    def _has_room(self, key: str) -> bool:
        """A smoothed score at least `adapter_home_min_score` of the best pod's (a queue that lasts,
        not one scrape with requests waiting), and no hot adapter taken in this
        decision."""
        return (
            key not in self.received
            and self.pods[key].score >= self.tuning.adapter_home_min_score * self.best
        )

    def _load_per_slot(self, key: str) -> tuple[float, str, str]:
        return self.pods[key].load / self.pods[key].slots, *self._named(key)

    def _parking(self, key: str) -> tuple[float, float, int, str, str]:
        """Where an adapter with no slot anywhere waits, in a crowded pool: the pod with
        the least load for its capacity, counting the demand parked on it in this
        decision, then the fewest adapters per slot, then the one whose adapters are
        listed last (at a cold start, with no load anywhere, adapters are dealt out in
        turn, the hottest listed first, so that no pod collects every waiting adapter:
        all ten went to the first pod by name before, 189 of 376 requests on one pod of
        four)."""
        pod = self.pods[key]
        held = self.advertised[key]
        last = max((self.listed[a] for a in held), default=len(self.listed))
        return (
            (pod.load + self.parked[key]) / pod.capacity,
            len(held) / pod.slots,
            -last,
            *self._named(key),
        )

    def _relieve_overfed(self, interval_s: float) -> None:
        """Rule 4, in a crowded pool: the pod fed furthest beyond its capacity's share of
        the load (by `adapter_share_tolerance`), with requests waiting, gives one adapter to
        a pod under its share that can load it at once, one whose slots will not all be in
        use (the cost is a load, `adapter_load_s`; a pod with its slots in use loads a new
        adapter only once one of its own has drained, seconds later). The move is made
        when the requests the overfed pod holds beyond its share, each waiting at least
        until the next decision, wait longer in all than the load stalls the receiver's
        batch. It gives the hottest adapter it runs whose requests leave the receiver
        below it (no move back: the pair's larger load only falls), else one waiting
        there for a slot (`_to_give`). One move per
        decision; an adapter on its way (requests on a pod that no longer advertises it)
        counts on the pods that do, so that the next decisions, before its requests show
        there, do not fill the same idle slot again."""
        load, used = self._expected()
        total = sum(load.values())
        capacity = sum(pod.capacity for pod in self.pods.values())
        if total <= 0 or capacity <= 0:
            return
        share = {key: total * pod.capacity / capacity for key, pod in self.pods.items()}
        overfed = max(self.pods, key=lambda k: (load[k] / self.pods[k].capacity, *self._named(k)))
        pod = self.pods[overfed]
        if (
            not pod.waiting
            or load[overfed] <= (1 + self.tuning.adapter_share_tolerance) * (share[overfed])
        ):
            return
        receiver = min(
            (k for k in self.pods if k != overfed and self._can_take(k, load, share, used)),
            key=lambda k: (load[k] / self.pods[k].capacity, *self._named(k)),
            default=None,
        )
        if receiver is None:
            return
        waits = min(pod.queued, load[overfed] - share[overfed]) * interval_s
        stalls = self.tuning.adapter_load_s * (
            self.pods[receiver].load - self.pods[receiver].queued + 1
        )
        if waits <= stalls:
            return
        for adapter in self._to_give(overfed, receiver):
            moved = self.carried[overfed].get(adapter, 0.0)
            if (load[receiver] + moved) / self.pods[receiver].capacity < load[
                overfed
            ] / pod.capacity:
                self.advertised[overfed].discard(adapter)
                self.advertised[receiver].add(adapter)
                self.received.add(receiver)
                return

    def _can_take(
        self,
        key: str,
        load: Mapping[str, float],
        share: Mapping[str, float],
        used: Mapping[str, set[str]],
    ) -> bool:
        """Rule 4's receivers: under their share, with room (`_has_room`), and a slot that
        nothing on its way will take."""
        return (
            load[key] < share[key] and len(used[key]) < self.pods[key].slots and self._has_room(key)
        )

    def _expected(self) -> tuple[dict[str, float], dict[str, set[str]]]:
        """Each pod's load and the adapters that will use its slots once the adapters
        moved off other pods arrive: the adapters of its requests (one that drains holds
        its slot until it has), and those on their way to it, with their requests on pods
        that no longer advertise them (their demand counts where they go)."""
        load = {key: pod.load for key, pod in self.pods.items()}
        used = {key: set(pod.adapters) for key, pod in self.pods.items()}
        for key, pod in self.pods.items():
            for adapter in sorted(pod.adapters - self.advertised[key]):
                holders = self._holders(adapter)
                moved = self.carried[key].get(adapter, 0.0)
                for holder in holders:
                    load[holder] += moved / len(holders)
                    used[holder].add(adapter)
                if holders:
                    load[key] -= moved
        return load, used

    def _to_give(self, overfed: str, receiver: str) -> list[str]:
        """The adapters the overfed pod has requests of and advertises, that the receiver
        lacks, in the order rule 4 tries them: those it runs first (one given away drains
        there, and frees its slot for an adapter waiting for one: its requests already
        queued in the pod would wait for that slot whatever the next ones do), then the
        most demand it carries, then listed first (an adapter without requests there
        would relieve it of nothing)."""
        pod = self.pods[overfed]
        carried = self.carried[overfed]
        return sorted(
            (
                a
                for a in self.advertised[overfed] & pod.adapters
                if a not in self.advertised[receiver]
            ),
            key=lambda a: (a not in pod.running_adapters, -carried.get(a, 0.0), self.listed[a]),
        )

    def _drop_idle_replica(self, adapter: str) -> None:
        """Rule 3."""
        holders = self._holders(adapter)
        if len(holders) < 2 or any(self.pods[k].waiting for k in holders):
            return
        if self.demand[adapter] / len(holders) < self.tuning.idle_replica_share * self.mean_load:
            busiest = max(holders, key=lambda k: (self.pods[k].load, *self._named(k)))
            self.advertised[busiest].discard(adapter)
