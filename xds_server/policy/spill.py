"""Which pods of a session-affinity pool spill their keys to other pods, and why.

A pod loaded beyond the others sends its keys' new requests elsewhere for a while
(envoy/endpoints.py), and is DEGRADED in the pool with its weight cut. Each rule below is
a named predicate that returns its reason, or None; `spill_reason` applies them in this
order of precedence (docs/routing.md has the measurements behind each):

1. `queue_beyond_peers`: the pod queues beyond `queue_slack` plus `spill_queue_ratio`
   times the other pods' median queue. Beside a batch under `spill_release` of the
   pool's `batch_limit`, a queue is a prefill backlog that the next steps clear: it
   counts only beyond what moving costs (`miss_cost`, the extra prefill of a request
   whose prefix is cached where it is). Applies to every pod.
2. `holds_while_full`: a spilling pod keeps spilling while it has no free slot (its
   running and waiting requests fill the limit): its keys would only queue again.
   Applies to every pod, before the prefix-cache exemption (which once ran first: a full
   real vLLM whose queue read short for one scrape took its keys back, and they waited
   there). A pod with a free slot and a cache that pays takes its keys back.
3. `prefix_cache_pays`: a pod whose prefix cache serves `spill_max_hit_rate` of its
   prompt tokens or more keeps its keys through a full batch, and so do all pods when
   the pool's `batch_limit` is unknown: the rules below are skipped.
4. `batch_full`: the other pods queue nothing and the pod's batch reaches
   `spill_full` of the limit.
5. `batch_ahead`: the other pods queue nothing and the pod runs `spill_ahead` times
   their median batch or more, from `spill_ahead_full` of the limit: a hot key's pod.
6. `held`: a spilling pod keeps spilling while its batch is at `spill_release` of the
   limit or more (released at its first short queue, a full pod took its keys back and
   queued again at once).

At most `max_spilling_share` of the healthy pods spill, the most loaded first; the others
that qualified are `spill_capped`. When every healthy pod would spill (loaded, or
prefilling a long prompt), none does: the pool is full everywhere, and moving keys would
only lose their prefixes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from xds_server.config import BalancingConfig
from xds_server.policy.capacity import median_without
from xds_server.policy.reasons import Reason
from xds_server.policy.signals import PodSignals
from xds_server.tuning import MIN_RELATIVE_CAPACITY, Tuning

__all__ = ["SpillView", "Spilling", "miss_cost", "spill_reason", "spilling"]


@dataclass(frozen=True, kw_only=True)
class SpillView:
    """What the spill rules read of one pool: its fresh healthy pods' signals."""

    fresh: Mapping[str, PodSignals]
    spilled: Set[str]
    limit: int | None
    settings: BalancingConfig
    tuning: Tuning
    ordered_queues: Sequence[float]
    ordered_running: Sequence[float]

    @classmethod
    def of(
        cls,
        present: Sequence[str],
        fresh: Mapping[str, PodSignals],
        *,
        spilled: Set[str],
        limit: int | None,
        settings: BalancingConfig,
        tuning: Tuning,
    ) -> SpillView:
        return cls(
            fresh=fresh,
            spilled=spilled,
            limit=limit,
            settings=settings,
            tuning=tuning,
            ordered_queues=sorted(fresh[key].waiting for key in present),
            ordered_running=sorted(fresh[key].running for key in present),
        )

    def typical_queue(self, key: str) -> float:
        """The median queue of the other pods (0 without any)."""
        return _typical(self.ordered_queues, self.fresh[key].waiting)

    def typical_running(self, key: str) -> float:
        """The median batch of the other pods (0 without any)."""
        return _typical(self.ordered_running, self.fresh[key].running)


def _typical(ordered: Sequence[float], value: float) -> float:
    return median_without(ordered, value) if len(ordered) > 1 else 0.0


def miss_cost(hit_rate: float, tuning: Tuning) -> float:
    """The extra prefill of a request whose key moves, in prefills of a request that stays:
    a prompt whose cached share on its pod is `hit_rate` prefills 1 - hit_rate of its
    tokens there and all of them elsewhere (for want of per-request figures, the pod's
    rate stands in for every request's)."""
    cached = min(hit_rate, tuning.max_miss_cost_hit_rate)
    return cached / (1.0 - cached)


def queue_beyond_peers(view: SpillView, key: str) -> Reason | None:
    signals = view.fresh[key]
    typical = view.typical_queue(key)
    limit = view.limit
    backlog = limit is not None and signals.running < view.tuning.spill_release * limit
    worth = miss_cost(signals.prefix_hit_rate or 0.0, view.tuning) if backlog else 0.0
    bound = view.settings.queue_slack + view.tuning.spill_queue_ratio * typical + worth
    if signals.waiting > bound:
        return Reason(
            "spill_queue",
            f"queue {signals.waiting:g} > slack {view.settings.queue_slack}"
            f" + {view.tuning.spill_queue_ratio:g}x others' median {typical:g}"
            + (f" + miss cost {worth:.2g}" if worth else ""),
        )
    return None


def holds_while_full(view: SpillView, key: str) -> Reason | None:
    signals = view.fresh[key]
    limit = view.limit
    if limit is not None and key in view.spilled and signals.running + signals.waiting >= limit:
        return Reason(
            "spill_held",
            f"no free slot: {signals.running:g} running + {signals.waiting:g} waiting"
            f" of limit {limit}",
        )
    return None


def prefix_cache_pays(view: SpillView, key: str) -> bool:
    hit_rate = view.fresh[key].prefix_hit_rate or 0.0
    return view.limit is None or hit_rate >= view.tuning.spill_max_hit_rate


def batch_full(view: SpillView, key: str, limit: int) -> Reason | None:
    running = view.fresh[key].running
    if view.typical_queue(key) == 0 and running >= view.tuning.spill_full * limit:
        return Reason(
            "spill_batch_full",
            f"batch {running:g} of limit {limit} >= {view.tuning.spill_full:g}, others idle",
        )
    return None


def batch_ahead(view: SpillView, key: str, limit: int) -> Reason | None:
    running = view.fresh[key].running
    typical = view.typical_running(key)
    tuning = view.tuning
    if (
        view.typical_queue(key) == 0
        and running >= tuning.spill_ahead_full * limit
        and running >= tuning.spill_ahead * typical
    ):
        return Reason(
            "spill_batch_ahead",
            f"batch {running:g} of limit {limit} >= {tuning.spill_ahead_full:g},"
            f" >= {tuning.spill_ahead:g}x others' median {typical:g}",
        )
    return None


def held(view: SpillView, key: str, limit: int) -> Reason | None:
    running = view.fresh[key].running
    if key in view.spilled and running >= view.tuning.spill_release * limit:
        return Reason(
            "spill_held",
            f"batch {running:g} of limit {limit} >= release {view.tuning.spill_release:g}",
        )
    return None


def spill_reason(view: SpillView, key: str) -> Reason | None:
    """Why pod `key` should spill its keys, by the rules in order (module docstring)."""
    reason = queue_beyond_peers(view, key) or holds_while_full(view, key)
    if reason is not None or prefix_cache_pays(view, key) or view.limit is None:
        return reason
    limit = view.limit
    return batch_full(view, key, limit) or batch_ahead(view, key, limit) or held(view, key, limit)


@dataclass(frozen=True, kw_only=True)
class Spilling:
    """A pool's spill decision: the pods spilling for load, those prefilling long prompts,
    and every reason given (including pods capped, or a pool full everywhere)."""

    loaded: frozenset[str] = frozenset()
    prefilling: frozenset[str] = frozenset()
    reasons: Mapping[str, Reason] = field(default_factory=dict)

    @property
    def pods(self) -> frozenset[str]:
        return self.loaded | self.prefilling


def spilling(
    healthy: Sequence[str],
    fresh: Mapping[str, PodSignals],
    capacities: Mapping[str, float],
    *,
    spilled: Set[str],
    long_prompts: Mapping[str, int],
    session_affinity: bool,
    limit: int | None,
    settings: BalancingConfig,
    tuning: Tuning,
) -> Spilling:
    """The pods that spill (module docstring). `spilled`: those that spilled last time."""
    prefilling = {key for key in healthy if long_prompts.get(key, 0) > 0}
    reasons: dict[str, Reason] = {
        key: Reason("long_prompt", f"{long_prompts[key]} long prompt(s) prefilling")
        for key in prefilling
    }
    loaded: frozenset[str] = frozenset()
    if session_affinity:
        present = [key for key in healthy if key in fresh]
        view = SpillView.of(
            present, fresh, spilled=spilled, limit=limit, settings=settings, tuning=tuning
        )
        found = {key: r for key in present if (r := spill_reason(view, key)) is not None}
        ranked = sorted(
            found,
            key=lambda k: (
                -fresh[k].waiting,
                -fresh[k].running / max(capacities.get(k, 1.0), MIN_RELATIVE_CAPACITY),
                k,
            ),
        )
        allowed = math.floor(len(healthy) * tuning.max_spilling_share)
        loaded = frozenset(ranked[:allowed])
        for key in ranked:
            reasons[key] = (
                found[key]
                if key in loaded
                else Reason("spill_capped", f"{found[key]}; at most {allowed} pods spill")
            )
    if loaded | prefilling >= set(healthy):
        for key in loaded | prefilling:
            reasons[key] = Reason("spill_everywhere", f"{reasons[key]}; every pod would spill")
        return Spilling(reasons=reasons)
    return Spilling(loaded=loaded, prefilling=frozenset(prefilling), reasons=reasons)
