"""Session keys: how sticky each key stays, how fast a heavy key leaves a pod that queues
(scenario h, hot keys), and how evenly keys spread over the pods (prefix groups).

Issue 17 asks, with session affinity on: the heavy keys' requests spill within one update
interval of their pod queueing, and the keys of unloaded pods keep at least 95%
stickiness. A key is a request's `user` (the trace's `TraceRequest.user`); the pod that
served a request is the response's `x-backend-id`. Only requests answered 200 count.

`key_stickiness`, per key, is the fraction of its requests served by its most-used pod
(its "home"). Heavy keys are reported one by one (`heavy`, with `heavy_homes`); light keys
as groups, each with `keys`, `requests`, `weighted` (all the group's requests on their
key's home over all its requests: what the target is checked on) and `median` and `min`
over the keys with at least `MIN_KEY_REQUESTS` requests (a key seen twice is 50% or 100%
sticky, whatever the policy):

- `light_unloaded`: light keys whose home is no heavy key's home. The definition holds
  for every policy, and is what "keys of unloaded pods" means here;
- `light_never_queued`: light keys whose home never queued in the measured window, by the
  simulator's own queue (below); empty when every pod queued at some point;
- `light_all`: every light key;
- `light_calm` (the project only, from the server's decisions): light keys whose pod the
  server never took off the session table in the measured window, and no heavy key lives
  on; a key's pod is where its requests went while no pod was off the table (the ring's
  choice), and its stickiness counts its requests there. This is "keys of unloaded pods"
  for a policy that spills: with "most-used pod", a light key of a pod that spilled for
  most of the run has its spill target as its home, an unloaded pod, and counts as a
  key of an unloaded pod that moved.

`group_homes` (scenarios with prefix groups, c and c96) is the same view of the prefix
groups, whose requests carry their group as `prompt_cache_key`: how many groups, and
requests, each pod is home to. It shows how evenly a policy spreads the keys it keeps.

`spill_reaction_s` is measured on queueing episodes: a pod queues while the simulator's
engine has more than `queue_slack` requests waiting (the server's own threshold,
`balancing.queue_slack`, read here from the exact engine state `QueueSampler` samples
every 20 ms, not from a scrape). Stretches less than 100 ms apart are one episode, and
an episode shorter than 100 ms (two engine steps) is not a queue: requests that arrive
during a step wait for the next one even on an idle pod (`short_episodes`, counted per
pod, and otherwise ignored). For each heavy key and each episode starting in the
measured window on the pod that key's previous request went to (`episodes`), the
reaction is the time from the episode's start to the first request of that key sent to
another pod, when that happens before the episode ends (`spilled`); `median` and `max`
are over those. `stayed_max_s` is the latest request of the key still sent to the
queueing pod during the episode, after its start (0 when none): it bounds the routing's
reaction without waiting for the key's next request, as requests_to_dead_pod_after_s
does for scenario g. Episodes during which the key sent requests, all to the queueing
pod, are `unspilled` (with the longest one's duration); those during which it sent none
are `idle`. For the project, the sampler also reads which pods the server has off the
session table (`spilling`): `decision_median` and `decision_max` are the times from an
episode's start to the server's decision, over the episodes it decided within
(`undecided`: the others).

Round robin, least request and the oracle do not keep keys, so their figures say how
sticky keys are by chance; the spill figures are meaningful for the project.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from llm_sim.fleet import Fleet
from llm_sim.loadgen import ReplayResult, RequestResult
from llm_sim.loadgen.trace import Trace

__all__ = [
    "HEAVY_PREFIX",
    "MIN_KEY_REQUESTS",
    "PodDecision",
    "QueueEpisode",
    "QueueSampler",
    "group_homes",
    "key_figures",
    "queue_episodes",
]

# Keys with fewer requests are left out of the per-key median and min (not the weighted).
MIN_KEY_REQUESTS = 3
# How the trace names heavy users (llm_sim.loadgen.trace: `user-heavy-<k>`).
HEAVY_PREFIX = "user-heavy-"
_OK = 200


@dataclass(frozen=True)
class QueueEpisode:
    """Pod `pod` had more than the slack waiting from `start` to `end` (Unix seconds)."""

    pod: str
    start: float
    end: float


class PodDecision(NamedTuple):
    """A pod in the server's decision: its weight in the pool, whether it spills its keys
    (off the session table), its ring weight in the session table (None without one), and
    whether the pool's keys are suspended (affinity does not pay: policy/affinity.py)."""

    weight: int
    spilling: bool
    ring_weight: int | None
    keys_suspended: bool = False


class QueueSampler:
    """Samples every pod's waiting and running requests every `INTERVAL_S` while a trace
    replays, and with `decision` (each pod's `PodDecision` in the server's current
    decision) the server's decisions too. Mutable state: `_samples` (Unix time, waiting
    per pod), `_running` (running per pod, one per sample) and `_decisions` (Unix time,
    decision per pod), appended to while running."""

    INTERVAL_S = 0.02
    # Stretches of queueing closer than this are one episode, and a shorter one is none.
    MERGE_S = 0.1
    MIN_EPISODE_S = 0.1

    def __init__(
        self,
        fleet: Fleet,
        *,
        decision: Callable[[], Mapping[str, PodDecision]] | None = None,
    ) -> None:
        self._fleet = fleet
        self._decision = decision
        self._samples: list[tuple[float, dict[str, int]]] = []
        self._running: list[dict[str, int]] = []
        self._decisions: list[tuple[float, dict[str, PodDecision]]] = []

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async def sample() -> None:
            while True:
                now = time.time()
                engines = {p.name: p.state_snapshot().engine for p in self._fleet}
                self._samples.append((now, {n: e.num_waiting for n, e in engines.items()}))
                self._running.append({n: e.num_running for n, e in engines.items()})
                if self._decision is not None:
                    self._decisions.append((now, dict(self._decision())))
                await asyncio.sleep(self.INTERVAL_S)

        task = asyncio.create_task(sample())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def episodes(self, *, slack: int) -> list[QueueEpisode]:
        """Every pod's queueing episodes (more than `slack` waiting), in start order, the
        short ones too (`key_figures` sets them apart)."""
        return queue_episodes(self._samples, slack=slack, merge_s=self.MERGE_S)

    @property
    def spilled(self) -> list[tuple[float, frozenset[str]]]:
        """(Unix time, pods off the session table) samples; empty without `decision`."""
        return [
            (t, frozenset(pod for pod, decision in pods.items() if decision.spilling))
            for t, pods in self._decisions
        ]

    def save(self, path: Path, *, slack: int) -> None:
        """The episodes, every sample ([time, {pod: [waiting, running]}]) and every change
        of the server's decision ([time, {pod: [weight, spill, ring weight]}]), as JSON,
        to see after a run why a figure is what it is."""
        changes = [
            (t, pods)
            for i, (t, pods) in enumerate(self._decisions)
            if i == 0 or pods != self._decisions[i - 1][1]
        ]
        samples = [
            (t, {pod: (waiting[pod], running.get(pod, 0)) for pod in waiting})
            for (t, waiting), running in zip(self._samples, self._running, strict=True)
        ]
        document = {
            "episodes": [[e.pod, e.start, e.end] for e in self.episodes(slack=slack)],
            "samples": samples,
            "decisions": changes,
        }
        path.write_text(json.dumps(document))


def queue_episodes(
    samples: Sequence[tuple[float, Mapping[str, int]]], *, slack: int, merge_s: float
) -> list[QueueEpisode]:
    """The stretches of `samples` (time, waiting per pod) where a pod has more than `slack`
    waiting: from the first such sample to the first one after it without; stretches less
    than `merge_s` apart are merged. An episode still open at the end ends there."""
    episodes: list[QueueEpisode] = []
    pods = sorted({pod for _, waiting in samples for pod in waiting})
    for pod in pods:
        spans: list[list[float]] = []
        start: float | None = None
        for t, waiting in samples:
            queued = waiting.get(pod, 0) > slack
            if queued and start is None:
                start = t
            elif not queued and start is not None:
                if spans and start - spans[-1][1] < merge_s:
                    spans[-1][1] = t
                else:
                    spans.append([start, t])
                start = None
        if start is not None:
            spans.append([start, samples[-1][0]])
        episodes += [QueueEpisode(pod, a, b) for a, b in spans]
    return sorted(episodes, key=lambda e: (e.start, e.pod))


@dataclass(frozen=True)
class _Sent:
    key: str
    at: float  # Unix time the request was sent
    pod: str


def _sent(trace: Trace, results: Iterable[RequestResult], *, started_at_unix: float) -> list[_Sent]:
    sent = []
    for r in results:
        key = trace.requests[r.index].user
        if key is None or r.status != _OK or not r.backend_id:
            continue
        sent.append(_Sent(key, started_at_unix + r.scheduled_at_s + r.lateness_s, r.backend_id))
    return sorted(sent, key=lambda s: s.at)


def _group(
    per_key: Mapping[str, Counter[str]], homes: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The group's stickiness: on each key's most-used pod, or on its pod in `homes`."""

    def on_home(key: str, pods: Counter[str]) -> int:
        return pods[homes[key]] if homes is not None else max(pods.values())

    requests = sum(sum(c.values()) for c in per_key.values())
    shares = [on_home(k, c) / sum(c.values()) for k, c in per_key.items()]
    counted = [
        on_home(k, c) / sum(c.values())
        for k, c in per_key.items()
        if sum(c.values()) >= MIN_KEY_REQUESTS
    ]
    return {
        "keys": len(shares),
        "requests": requests,
        "weighted": sum(on_home(k, c) for k, c in per_key.items()) / requests if requests else None,
        "median": statistics.median(counted) if counted else None,
        "min": min(counted) if counted else None,
    }


def key_figures(
    trace: Trace,
    result: ReplayResult,
    *,
    episodes: Sequence[QueueEpisode],
    spilled: Sequence[tuple[float, Collection[str]]] = (),
    warmup_s: float = 0.0,
) -> dict[str, Any]:
    """`key_stickiness` and `spill_reaction_s` (see the module docstring) for the requests
    of `result` scheduled after `warmup_s`, with `episodes` and `spilled` (the server's
    spilled pods over time, or nothing) from a `QueueSampler`."""
    measured = [r for r in result.results if r.scheduled_at_s >= warmup_s]
    sent = _sent(trace, measured, started_at_unix=result.started_at_unix)
    per_key: dict[str, Counter[str]] = defaultdict(Counter)
    for s in sent:
        per_key[s.key][s.pod] += 1
    homes = {key: pods.most_common(1)[0][0] for key, pods in per_key.items()}
    heavy = sorted(k for k in per_key if k.startswith(HEAVY_PREFIX))
    light = {k: c for k, c in per_key.items() if not k.startswith(HEAVY_PREFIX)}
    heavy_homes = {homes[k] for k in heavy}
    window_start = result.started_at_unix + warmup_s
    queues = [e for e in episodes if e.end - e.start >= QueueSampler.MIN_EPISODE_S]
    in_window = [e for e in queues if e.end >= window_start]
    queued_pods = {e.pod for e in in_window}
    stickiness = {
        "heavy": {k: max(per_key[k].values()) / sum(per_key[k].values()) for k in heavy},
        "heavy_homes": {k: homes[k] for k in heavy},
        "light_unloaded": _group({k: c for k, c in light.items() if homes[k] not in heavy_homes}),
        "light_never_queued": _group(
            {k: c for k, c in light.items() if homes[k] not in queued_pods}
        ),
        "light_all": _group(light),
    }
    if spilled:
        stickiness["light_calm"] = _calm_group(sent, light, heavy_homes, spilled, window_start)
    starting = [e for e in in_window if e.start >= window_start]
    spill = _spill_reactions(sent, heavy, starting, spilled)
    spill["short_episodes"] = sum(
        1 for e in episodes if e.start >= window_start and e not in queues
    )
    return {"key_stickiness": stickiness, "spill_reaction_s": spill}


def group_homes(
    trace: Trace, result: ReplayResult, *, pods: Collection[str], warmup_s: float = 0.0
) -> dict[str, Any]:
    """Where the prefix groups of `trace` (a shared system prompt and one session key
    each) live on `pods`, over the requests of `result` scheduled after `warmup_s`: a
    group's home is the pod that served most of its requests. `groups_per_pod` and
    `requests_per_pod` are sorted from the busiest pod; `requests_max_over_mean` is the
    busiest pod's requests over the mean pod's (1.0: an even spread); `off_home_requests`
    were served away from their group's home (a prefix-cache miss unless that pod held
    the prefix too)."""
    per_group: dict[int, Counter[str]] = defaultdict(Counter)
    for r in result.results:
        group = trace.requests[r.index].prefix_group
        if r.scheduled_at_s < warmup_s or group is None or r.status != _OK or not r.backend_id:
            continue
        per_group[group][r.backend_id] += 1
    homes = Counter({pod: 0 for pod in pods})
    homes.update(served.most_common(1)[0][0] for served in per_group.values())
    requests = Counter({pod: 0 for pod in pods})
    for served in per_group.values():
        requests.update(served)
    total = sum(requests.values())
    return {
        "groups_per_pod": sorted(homes.values(), reverse=True),
        "requests_per_pod": sorted(requests.values(), reverse=True),
        "requests_max_over_mean": max(requests.values()) * len(requests) / total if total else None,
        "off_home_requests": sum(
            sum(served.values()) - served.most_common(1)[0][1] for served in per_group.values()
        ),
    }


def _calm_group(
    sent: Sequence[_Sent],
    light: Mapping[str, Counter[str]],
    heavy_homes: Collection[str],
    spilled: Sequence[tuple[float, Collection[str]]],
    window_start: float,
) -> dict[str, Any]:
    """`light_calm` (the project only): light keys whose pod the server never took off the
    session table in the window, and no heavy key lives on. A key's pod is where its
    requests went while no pod was off the table (the ring's choice for it); its
    stickiness counts its requests there."""
    times = [t for t, _ in spilled]
    ever_spilled = {pod for t, pods in spilled if t >= window_start for pod in pods}
    calm_sends: dict[str, Counter[str]] = defaultdict(Counter)
    for s in sent:
        index = bisect.bisect_right(times, s.at) - 1
        if s.key in light and (index < 0 or not spilled[index][1]):
            calm_sends[s.key][s.pod] += 1
    homes = {key: pods.most_common(1)[0][0] for key, pods in calm_sends.items()}
    calm = {
        key: light[key]
        for key, home in homes.items()
        if home not in ever_spilled and home not in heavy_homes
    }
    return _group(calm, homes)


def _decided_after(
    spilled: Sequence[tuple[float, Collection[str]]], episode: QueueEpisode
) -> float | None:
    """Seconds from `episode`'s start to the first sample, during it, where the server had
    its pod off the session table (0 if it already had); None: never during it."""
    return next(
        (
            max(0.0, t - episode.start)
            for t, pods in spilled
            if episode.start - QueueSampler.INTERVAL_S <= t <= episode.end and episode.pod in pods
        ),
        None,
    )


def _spill_reactions(
    sent: Sequence[_Sent],
    heavy: Sequence[str],
    episodes: Sequence[QueueEpisode],
    spilled: Sequence[tuple[float, Collection[str]]],
) -> dict[str, Any]:
    reactions: list[float] = []
    stayed: list[float] = []
    unspilled: list[float] = []
    idle = 0
    decisions: list[float | None] = []
    for key in heavy:
        mine = [s for s in sent if s.key == key]
        for episode in episodes:
            before = [s for s in mine if s.at < episode.start]
            if not before or before[-1].pod != episode.pod:
                continue  # the key was not on this pod when it began to queue
            if spilled:
                decisions.append(_decided_after(spilled, episode))
            during = [s for s in mine if episode.start <= s.at <= episode.end]
            stayed.append(
                max((s.at - episode.start for s in during if s.pod == episode.pod), default=0.0)
            )
            elsewhere = next((s for s in during if s.pod != episode.pod), None)
            if elsewhere is not None:
                reactions.append(elsewhere.at - episode.start)
            elif during:
                unspilled.append(episode.end - episode.start)
            else:
                idle += 1
    decided = [d for d in decisions if d is not None]
    return {
        "episodes": len(stayed),
        "spilled": len(reactions),
        "median": statistics.median(reactions) if reactions else None,
        "max": max(reactions, default=None),
        "stayed_max_s": max(stayed, default=None),
        "unspilled": len(unspilled),
        "unspilled_longest_s": max(unspilled, default=None),
        "idle": idle,
        "decision_median": statistics.median(decided) if decided else None,
        "decision_max": max(decided, default=None),
        "undecided": len(decisions) - len(decided),
    }
