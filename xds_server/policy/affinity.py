"""Whether session affinity pays for itself in a pool: keys sticky, or suspended.

Keeping a key on its pod saves the prefill of what that pod's prefix cache holds for it,
and costs whatever unevenness the keys bring (homes.py and the spill rules bound it, not
to zero: on scenario h, the heavy users' pods ran 30-40 of 48 while the others ran 10-20).
Where the cached prefix is short, the saving is small whatever the placement: on h, whose
users' prefixes are 256 tokens, round robin beat always-sticky keys, because every pod
caches every such prefix anyway (bench/results/affinity-pays/NOTES.md). What the cache
saves per request is measured, not assumed: the pods' prefix-cache hits per prefilled
request over the hit-rate window (metrics/store.py), averaged over the pool's pods
weighted by what each holds.

The rule, per pool with session affinity:
- sticky, and the pods' cached tokens per request stay under
  `Tuning.affinity_min_cached_tokens` for `affinity_streak_intervals` decisions in a row,
  with the pool busy: suspended. Its keys' requests are then balanced by load like
  unkeyed ones (envoy/endpoints.py points the session table at the spill listener);
- suspended, and the figure reaches `affinity_resume_factor` times the minimum for as many
  decisions: sticky again. While suspended the pods still see keyed traffic, spread: what
  their caches save then is what any pod saves, so a figure that rises there says the
  prefixes are long, and sticking can only save more.

A key's first request misses wherever it goes, so a fresh fleet (cold caches, every key
new) reads as short prefixes: on c@more-prefixes (64 groups of 3,072-token prefixes), a
new fleet's first requests were mostly first requests, and the keys were suspended there
at 7.9 s, their hits falling from about 80% to 30%. So while sticky, each pod's figure is
taken per return, the saving sticking is about: divided by the share of the keyed
requests it was sent that returned to it, their key last served by it (`returns`, from
the session-key log: xds/session_keys.py, whose sums start with the pod as its hits do).
A pod none returned to says nothing, and while no pod says, nothing is judged. On h,
whose returns save at most their 256-token prefix, the figure stays under the minimum,
and the keys are suspended as before. While suspended it is not divided: keys spread by
load return to a pod by chance, and what the caches save then is what any pod saves.

A pool whose pods export no request counter (TGI, Triton) stays sticky.

Pure: the last call's memory comes in, the next goes out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xds_server.policy.reasons import Reason
from xds_server.policy.signals import PodSignals
from xds_server.tuning import Tuning

__all__ = ["Affinity", "AffinityMemory", "affinity", "cached_tokens_per_request"]


@dataclass(frozen=True, kw_only=True)
class AffinityMemory:
    """Whether the pool's keys are suspended, and how many decisions in a row have argued
    for the other state."""

    suspended: bool = False
    streak: int = 0


@dataclass(frozen=True, kw_only=True)
class Affinity:
    memory: AffinityMemory
    # Why the keys are suspended (None while sticky).
    reason: Reason | None


def cached_tokens_per_request(
    healthy: Sequence[str],
    fresh: Mapping[str, PodSignals],
    returns: Mapping[str, float] | None = None,
) -> float | None:
    """The pool's prompt tokens saved per request by the prefix cache: the pods' figures,
    weighted by what each holds (running plus waiting, at least one); None when no pod says.
    With `returns` (per pod, the share of its keyed requests that returned to it), per
    return: a pod's figure over its share, a pod with a share of zero saying nothing (one
    the log has no word of is taken per request)."""
    known: list[tuple[float, float]] = []
    for key in healthy:
        signals = fresh.get(key)
        if signals is None or signals.cached_tokens_per_request is None:
            continue
        saved = signals.cached_tokens_per_request
        share = returns.get(key) if returns is not None else None
        if share is not None:
            if share <= 0:
                continue
            saved /= share
        known.append((saved, max(1.0, signals.running + signals.waiting)))
    if not known:
        return None
    return sum(saved * w for saved, w in known) / sum(w for _, w in known)


def affinity(
    healthy: Sequence[str],
    fresh: Mapping[str, PodSignals],
    memory: AffinityMemory,
    tuning: Tuning,
    returns: Mapping[str, float] | None = None,
) -> Affinity:
    """The pool's affinity after this decision (module docstring); `returns` is, per pod,
    the share of the keyed requests it was sent that returned to it (None: unknown, the
    figure taken per request)."""
    per_request = cached_tokens_per_request(healthy, fresh)
    busy = sum(s.running + s.waiting for k in healthy if (s := fresh.get(k)) is not None)
    minimum = tuning.affinity_min_cached_tokens
    saved = per_request
    if not memory.suspended and returns is not None:
        saved = cached_tokens_per_request(healthy, fresh, returns)
    if saved is None or busy < tuning.home_min_load * max(1, len(healthy)):
        argues = False  # no word, or an idle pool: nothing to learn from
    elif memory.suspended:
        argues = saved >= minimum * tuning.affinity_resume_factor
    else:
        argues = saved < minimum
    streak = memory.streak + 1 if argues else 0
    suspended = memory.suspended
    if streak >= tuning.affinity_streak_intervals:
        suspended, streak = not suspended, 0
    reason = None
    if suspended:
        figure = "unknown" if per_request is None else f"{per_request:.0f}"
        reason = Reason(
            "affinity_suspended",
            f"the prefix cache saves {figure} prompt tokens per request, under {minimum:.0f}:"
            " keys balanced by load",
        )
    return Affinity(memory=AffinityMemory(suspended=suspended, streak=streak), reason=reason)
