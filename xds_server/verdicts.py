"""Pods judged by what the Envoys see of them: stalled or failing, whatever their metrics say.

A pod can answer `/metrics` and `/health` while it serves nothing: an engine wedged after
its first chunk, a server that resets every request, a frozen process whose page the last
scrape still holds. Its metrics then look fine and the policy keeps it in rotation. The
Envoys know better: their load reports (LRS, per endpoint, every report interval) count
its requests in flight and those that finished or failed. This module reads that stream
(xds/load_reports.py hands it every accepted report) and gives each pod a verdict.

A request's completion is not in the reports as such: Envoy counts a request successful at
its response headers, and a model server sends those before its first token, so a stream
that never ends counts as a success. What finished in an interval is told from the
requests in flight: those the Envoy had on the pod before, plus those it issued, less
those still in flight; less the failures, it is what completed.

- **stalled**: the pod owes completions. Each report adds, for its requests in flight,
  `in flight x interval / L`, where L is the time a request takes on the pool's other pods
  (Little's law: their requests in flight over time, divided by their completions, over
  the last DECAY_S): what it should have finished in that time if it served like its
  peers. Any request it finishes clears the debt; L is at least the pod's own time per
  request as of its last completion, so a slower GPU of a mixed pool is judged by its own
  pace. Owing `stall_after_owed` completions (config.VerdictsConfig) with at least
  MIN_STALLED_IN_FLIGHT requests in flight makes the pod a suspect, no more: requests of
  one size started together finish together, a request's time apart (with 32 clients of
  identical requests, healthy pods owed 6 to 10 between cohorts), and one long
  generation keeps a pod quiet as long. A suspect is probed at once (below): a probe
  whose answer, once begun, is not done within `confirm_timeout_s` is the verdict (its
  first chunk may wait `probe_timeout_s` behind the pod's queue: under load, pods of
  scenario c did not answer within a second and were judged stalled), a probe served
  clears the debt. A probe whose answer never began waited behind the pod's queue, and
  clears the suspicion, unless the pod has given no metrics page since it (re)started
  (`unpaged`: on probation, policy/health.py): its engine's counters cannot judge a pod
  that begins nothing, and it holds no queue of its own making (it is sent a small share),
  so it is stalled.
- **failing**: of its requests finished over the last FAILURE_DECAY_S, at least
  `min_failures` failed and they are `failure_ratio` of all (resets, connect failures,
  5xx: Envoy counts each try, so a retried request counts on the pod that failed it).

- **slowness**, no verdict but a measure: a pod whose requests take SLOW_RATIO times
  its peers' (over the last SLOW_DECAY_S) gains a step once that lasted SLOW_STEP_S and
  one every SLOW_STEP_S after (up to MAX_SLOW_STEPS), and loses one every
  SLOW_RECOVERY_S it does not: slowness is remembered for minutes. (Over one second, a
  pool of four honest pods at 60% load showed some slowness most of the time: the
  window and the wait are what keep them at none.) While a pod has any,
  the policy believes no more of the KV capacity it claims than the median of its
  peers' claims (policy/scoring.py): a pod claiming four times the cache it has takes
  the traffic of four until its requests slow down, a few seconds, then its share. A
  pod slower for being smaller claims less, and keeps its claim.

At most half a pool's pods are judged at once (as Envoy ejects at most half a pool): when
more look stalled or failing, the fault is not theirs alone (a pace misjudged, a request
every pod fails), and a pool of one is never judged.

A verdict takes the pod out of rotation at the next decision (fleet_load.py hands the
verdicts to the policy as load; policy/scoring.py). It comes back when a probe succeeds
(a request leaving its count in flight is no evidence: a client that gave up on a stuck
stream leaves it too): the server sends it a two-token streamed completion of its pool's
first model and wants it finished within `probe_timeout_s` (sources/probe.py). Probes
start PROBE_FIRST_S after the verdict and back off, doubling, to `probe_max_interval_s`.

Verdicts are this replica's own: each replica hears only its own Envoys' reports. A pod
that fails its requests is judged by every replica whose Envoys send it any.

Mutable state, all on the event loop: per pod its requests in flight per Envoy, the decayed
sums, its debt, verdict and probe schedule; per pool the decayed sums of its pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from xds_server.clock import Clock
from xds_server.config import RoutingConfig, VerdictsConfig
from xds_server.policy.signals import endpoint_id
from xds_server.sources.probe import ProbeFailure, probe_completion
from xds_server.xds.load_reports import ClusterLoad

__all__ = ["PROBE_FIRST_S", "PodVerdicts", "Probe", "Verdict", "run_probes"]

logger = logging.getLogger(__name__)

Reason = Literal["stalled", "failing"]

# The memory of a pool's pace (time per request) and of a pod's failures, in seconds.
DECAY_S = 10.0
FAILURE_DECAY_S = 1.0
# Completions a pool's other pods must have finished (decayed) before L is trusted.
MIN_PEER_COMPLETIONS = 3.0
# A suspected pod has also finished nothing for at least this long (a report or two).
MIN_QUIET_S = 0.5
# Fewer requests in flight than this are never a stall: one long generation among short
# ones keeps a pod quiet for many times its pool's pace.
MIN_STALLED_IN_FLIGHT = 3
# Slowness (module docstring): measured over this long, a pod this many times slower
# per request than its peers gains a step every SLOW_STEP_S, up to MAX_SLOW_STEPS, and
# loses one every SLOW_RECOVERY_S it is not.
SLOW_DECAY_S = 3.0
SLOW_RATIO = 1.5
SLOW_STEP_S = 1.5
SLOW_RECOVERY_S = 60.0
MAX_SLOW_STEPS = 4
# How often what the reports said is folded in and judged.
EVALUATE_S = 0.25
# The first probe of a judged pod, after its verdict.
PROBE_FIRST_S = 1.0


@dataclass(frozen=True)
class Verdict:
    reason: Reason
    # Monotonic time of the verdict, and what it was made from (for /debug and logs).
    since: float
    detail: str


class _Decayed:
    """A sum whose terms fade with time constant `tau_s`."""

    __slots__ = ("_at", "_tau_s", "_value")

    def __init__(self, tau_s: float) -> None:
        self._tau_s = tau_s
        self._value = 0.0
        self._at = 0.0

    def value(self, now: float) -> float:
        if now > self._at:
            self._value *= math.exp((self._at - now) / self._tau_s)
            self._at = now
        return self._value

    def add(self, amount: float, now: float) -> None:
        self._value = self.value(now) + amount

    def clear(self) -> None:
        self._value = 0.0


@dataclass
class _Pod:
    pool: str
    model: str
    in_flight: dict[str, int] = field(default_factory=dict)
    busy: _Decayed = field(default_factory=lambda: _Decayed(DECAY_S))
    done: _Decayed = field(default_factory=lambda: _Decayed(DECAY_S))
    recent_busy: _Decayed = field(default_factory=lambda: _Decayed(SLOW_DECAY_S))
    recent_done: _Decayed = field(default_factory=lambda: _Decayed(SLOW_DECAY_S))
    # Its slowness (`slow_steps`): steps now, since when it is slow, and when it last
    # stepped (or stopped being slow).
    slow_steps: int = 0
    slow_since: float | None = None
    stepped_at: float = 0.0
    recent_ok: _Decayed = field(default_factory=lambda: _Decayed(FAILURE_DECAY_S))
    recent_failed: _Decayed = field(default_factory=lambda: _Decayed(FAILURE_DECAY_S))
    owed: float = 0.0
    # Since when it has had requests in flight and finished none.
    quiet_since: float = 0.0
    # Its own time per request as of its last completion (None: too few to tell).
    own_pace: float | None = None
    verdict: Verdict | None = None
    next_probe_at: float = 0.0
    probe_interval_s: float = PROBE_FIRST_S
    probing: bool = False
    # What the reports since the last evaluation said: in flight x seconds, completed,
    # failed.
    pending: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    # Suspected stalled since (None: not): a probe with the confirmation bound decides.
    suspected_at: float | None = None
    suspicion: str = ""
    # A pod slower than its peers whose first probe's answer began and stopped: the next
    # one may take probe_timeout_s to finish (a slow pod's tokens come seconds apart; a
    # wedged one's never).
    second_look: bool = False


@dataclass
class _Pool:
    size: int = 0
    busy: _Decayed = field(default_factory=lambda: _Decayed(DECAY_S))
    done: _Decayed = field(default_factory=lambda: _Decayed(DECAY_S))
    recent_busy: _Decayed = field(default_factory=lambda: _Decayed(SLOW_DECAY_S))
    recent_done: _Decayed = field(default_factory=lambda: _Decayed(SLOW_DECAY_S))


class PodVerdicts:
    """Every GPU-aware pool's pods, judged from the load reports (module docstring).

    The LoadReports' observer (`reported`, `closed`). `config` gives the routing config in
    force (pods are judged within their pool); `on_change` is called when a verdict is
    made or lifted; `observe` with each verdict made ("stalled", "failing") for a metric;
    `unpaged(key)` says whether a pod has given no metrics page since it (re)started
    (module docstring: such a pod whose probe never begins is stalled).
    """

    def __init__(
        self,
        config: Callable[[], RoutingConfig | None],
        *,
        clock: Clock,
        on_change: Callable[[], None] = lambda: None,
        observe: Callable[[str], None] = lambda reason: None,
        wake: Callable[[], None] = lambda: None,
        unpaged: Callable[[str], bool] = lambda key: False,
    ) -> None:
        self._config = config
        self._unpaged = unpaged
        self._clock = clock
        self._on_change = on_change
        self._wake = wake
        self._observe = observe
        self._pods: dict[str, _Pod] = {}
        self._pools: dict[str, _Pool] = {}
        self._configured: RoutingConfig | None = None
        # Per Envoy, the pods it reported requests in flight on last, and when.
        self._reported: dict[str, set[str]] = {}
        self._last_report: dict[str, float] = {}
        # The pods reported on since the last evaluation, and when that was.
        self._active: set[str] = set()
        self._evaluated_at = -math.inf
        # Grows whenever a verdict is made or lifted, or a pod's slowness steps.
        self.revision = 0
        self._views: tuple[int, dict[str, tuple[dict[str, str], dict[str, int]]]] | None = None

    def _sync(self) -> RoutingConfig | None:
        """Follow the config in force: pods of GPU-aware pools, each in its first pool."""
        config = self._config()
        if config is self._configured:
            return config
        self._configured = config
        wanted: dict[str, tuple[str, str]] = {}
        if config is not None and config.verdicts.enabled:
            for pool in config.pools:
                if not pool.weights_from_metrics or not pool.models:
                    continue
                for endpoint in pool.endpoints:
                    wanted.setdefault(endpoint_id(endpoint), (pool.name, pool.models[0]))
        changed = False
        for key in list(self._pods):
            if wanted.get(key, ("", ""))[0] != self._pods[key].pool:
                changed |= self._pods.pop(key).verdict is not None
        for key, (pool_name, model) in wanted.items():
            if key not in self._pods:
                self._pods[key] = _Pod(pool=pool_name, model=model)
            else:
                self._pods[key].model = model
        pools = {pool_name for pool_name, _ in wanted.values()}
        self._pools = {name: self._pools.get(name) or _Pool() for name in pools}
        for pool_state in self._pools.values():
            pool_state.size = 0
        for pool_name, _ in wanted.values():
            self._pools[pool_name].size += 1
        if changed:
            self._changed()
        return config

    # -- the load reports' stream -----------------------------------------------------------

    def reported(self, node_id: str, loads: Mapping[str, ClusterLoad], now: float) -> None:
        """One Envoy's report: per pod, its requests in flight over the interval and those
        finished in it, summed over the clusters (a pod is in several: lanes, bands)."""
        config = self._sync()
        if config is None or not self._pods:
            return
        # The time its requests in flight stood for: since this Envoy's last report (a
        # cluster's own interval runs from its last report, which may be many ago).
        last = self._last_report.get(node_id)
        self._last_report[node_id] = now
        interval = min((load.interval_s for load in loads.values()), default=0.0)
        elapsed = interval if last is None else now - last
        # After a gap (a stream that reconnected), no more than a few intervals.
        dt = min(elapsed, 4 * interval) if interval > 0 else elapsed
        # Per pod: in flight, in flight x seconds, issued, failed.
        seen: dict[str, list[float]] = {}
        for load in loads.values():
            for key, count in load.by_endpoint.items():
                figures = seen.setdefault(key, [0, 0.0, 0, 0])
                figures[0] += count
                figures[1] += count * dt
            for key, (sent, failures) in load.issued_by_endpoint.items():
                figures = seen.setdefault(key, [0, 0.0, 0, 0])
                figures[2] += sent
                figures[3] += failures
        # A pod this Envoy had requests on and reports nothing of now finished them all.
        for key in self._reported.get(node_id, set()) - seen.keys():
            seen[key] = [0, 0.0, 0, 0]
        self._reported[node_id] = {key for key, figures in seen.items() if figures[0]}
        for key, (in_flight, busy, issued, failed) in seen.items():
            pod = self._pods.get(key)
            if pod is None:
                continue
            # Finished in the interval: issued, and in flight before, less still in flight.
            before = pod.in_flight.get(node_id, 0)
            if not pod.in_flight:
                pod.quiet_since = now
            if in_flight:
                pod.in_flight[node_id] = int(in_flight)
            else:
                pod.in_flight.pop(node_id, None)
            pending = pod.pending
            pending[0] += busy
            pending[1] += max(0.0, issued + before - in_flight - failed)
            pending[2] += failed
            self._active.add(key)
        if now - self._evaluated_at >= EVALUATE_S:
            self._evaluate(now, config)

    def _evaluate(self, now: float, config: RoutingConfig) -> None:
        """Fold what the reports since the last evaluation said of each pod into its sums,
        and judge it: once per EVALUATE_S whatever the number of Envoys reporting, so
        that a fleet's reports cost a pass over their entries, not over every pod's sums
        each (10,000 pods in one report: 43 ms judged per report)."""
        self._evaluated_at = now
        changed = False
        for key in self._active:
            pod = self._pods.get(key)
            if pod is None:
                continue
            busy, succeeded, failed = pod.pending
            pod.pending = [0.0, 0.0, 0.0]
            pool = self._pools[pod.pool]
            for sums in (pool, pod):
                sums.busy.add(busy, now)
                sums.done.add(succeeded, now)
                sums.recent_busy.add(busy, now)
                sums.recent_done.add(succeeded, now)
            pod.recent_ok.add(succeeded, now)
            pod.recent_failed.add(failed, now)
            pace = self._pace(pod, pool, now)
            if succeeded:
                pod.owed = 0.0
                pod.quiet_since = now
                done = pod.done.value(now)
                pod.own_pace = pod.busy.value(now) / done if done >= MIN_PEER_COMPLETIONS else None
            elif busy and pace is not None:
                pod.owed += busy / pace
            if pod.verdict is None:
                changed |= self._judge(key, pod, now, pace, config)
            if pod.verdict is None:
                changed |= self._step_slowness(key, pod, pool, now)
        self._active = set()
        if changed:
            self._changed()

    def closed(self, node_id: str) -> None:
        """An Envoy's load reports stopped: its requests in flight no longer count."""
        self._last_report.pop(node_id, None)
        for key in self._reported.pop(node_id, set()):
            pod = self._pods.get(key)
            if pod is not None:
                pod.in_flight.pop(node_id, None)

    def _pace(self, pod: _Pod, pool: _Pool, now: float) -> float | None:
        """Seconds per request on the pool's other pods (at least the pod's own, as of its
        last completion: since then a stalled pod's own would only grow), or None while
        they finished too few to tell."""
        peers_done = pool.done.value(now) - pod.done.value(now)
        if peers_done < MIN_PEER_COMPLETIONS:
            return None
        pace = (pool.busy.value(now) - pod.busy.value(now)) / peers_done
        if pod.own_pace is not None:
            pace = max(pace, pod.own_pace)
        return pace if pace > 0 else None

    def _slower_than_peers(self, pod: _Pod, now: float) -> bool:
        """Whether the pod is known to serve slower than its peers: slowness steps, or its
        own time per request SLOW_RATIO times theirs (an A10G beside H100s)."""
        if pod.slow_steps:
            return True
        pool = self._pools[pod.pool]
        peers_done = pool.done.value(now) - pod.done.value(now)
        if pod.own_pace is None or peers_done < MIN_PEER_COMPLETIONS:
            return False
        peers = (pool.busy.value(now) - pod.busy.value(now)) / peers_done
        return pod.own_pace > SLOW_RATIO * peers

    def _step_slowness(self, key: str, pod: _Pod, pool: _Pool, now: float) -> bool:
        """One step more of slowness every SLOW_STEP_S the pod takes SLOW_RATIO times its
        peers' time per request (over the last SLOW_DECAY_S), up to MAX_SLOW_STEPS; one
        step less every SLOW_RECOVERY_S it does not. True when the steps changed."""
        if (
            pod.done.value(now) < MIN_PEER_COMPLETIONS
            or pool.done.value(now) - pod.done.value(now) < MIN_PEER_COMPLETIONS
        ):
            return False
        # Over the last second or so: a pod that finished none has taken at least all of
        # its time in flight for one.
        done = pod.recent_done.value(now)
        peers_done = pool.recent_done.value(now) - done
        own = pod.recent_busy.value(now) / max(1.0, done)
        peers = (pool.recent_busy.value(now) - pod.recent_busy.value(now)) / max(1.0, peers_done)
        if own > SLOW_RATIO * peers:
            if pod.slow_since is None:
                pod.slow_since = now
            due = max(pod.slow_since, pod.stepped_at) + SLOW_STEP_S
            if pod.slow_steps < MAX_SLOW_STEPS and now >= due:
                pod.slow_steps += 1
                pod.stepped_at = now
                logger.info(
                    "Pod %s of pool %r takes %.2f s a request, its peers %.2f s: slowness %d.",
                    key, pod.pool, own, peers, pod.slow_steps,
                )  # fmt: skip
                return True
            return False
        if pod.slow_since is not None:
            pod.slow_since = None
            pod.stepped_at = now
        if pod.slow_steps and now >= pod.stepped_at + SLOW_RECOVERY_S:
            pod.slow_steps -= 1
            pod.stepped_at = now
            return True
        return False

    def _judge(
        self, key: str, pod: _Pod, now: float, pace: float | None, config: RoutingConfig
    ) -> bool:
        settings = config.verdicts
        in_flight = sum(pod.in_flight.values())
        if (
            pace is not None
            and pod.suspected_at is None
            and in_flight >= MIN_STALLED_IN_FLIGHT
            and pod.owed >= settings.stall_after_owed
            and now - pod.quiet_since >= MIN_QUIET_S
            and self._may_judge(pod)
        ):
            # Suspected: a probe, due now, confirms it (probed) or clears it.
            pod.suspected_at = pod.next_probe_at = now
            pod.suspicion = (
                f"owes {pod.owed:.1f} completions at its pool's pace ({pace:.2f} s a request),"
                f" {in_flight} in flight"
            )
            self._wake()
            return False
        failed, ok = pod.recent_failed.value(now), pod.recent_ok.value(now)
        if (
            failed >= settings.min_failures
            and failed >= settings.failure_ratio * (failed + ok)
            and self._may_judge(pod)
        ):
            detail = f"{failed:.0f} of its last {failed + ok:.0f} requests failed"
            return self._make(key, pod, "failing", now, detail)
        return False

    def _may_judge(self, pod: _Pod) -> bool:
        """Whether one more of the pod's pool may be judged (at most half of it). Asked
        only when a pod is about to be suspected or judged: it reads every pod."""
        judged = sum(1 for p in self._pods.values() if p.pool == pod.pool and p.verdict)
        return judged + 1 <= self._pools[pod.pool].size // 2

    def _make(self, key: str, pod: _Pod, reason: Reason, now: float, detail: str) -> bool:
        pod.verdict = Verdict(reason=reason, since=now, detail=detail)
        pod.probe_interval_s = PROBE_FIRST_S
        pod.next_probe_at = now + PROBE_FIRST_S
        self._observe(reason)
        logger.warning(
            "Pod %s of pool %r is %s (%s): out of rotation until it serves again.",
            key, pod.pool, reason, detail,
        )  # fmt: skip
        return True

    def _lift(self, key: str, pod: _Pod, why: str) -> bool:
        assert pod.verdict is not None
        logger.warning(
            "Pod %s of pool %r is back in rotation: %s (it was %s for %.1f s).",
            key, pod.pool, why, pod.verdict.reason, self._clock() - pod.verdict.since,
        )  # fmt: skip
        pod.verdict = None
        pod.owed = 0.0
        pod.quiet_since = self._clock()
        pod.recent_failed.clear()
        pod.recent_ok.clear()
        return True

    def _changed(self) -> None:
        self.revision += 1
        self._on_change()

    # -- probes -----------------------------------------------------------------------------

    def due_probes(self) -> list[tuple[str, str, float]]:
        """The probes due now, as (endpoint id, model, timeout): of judged pods, and of
        suspected ones (`confirm_timeout_s` from the answer's first chunk, which may take
        `probe_timeout_s`: run_probes); each pod is marked as being probed until `probed`
        says how it went."""
        config = self._sync()
        now = self._clock()
        settings = config.verdicts if config is not None else VerdictsConfig()
        due = []
        for key, pod in self._pods.items():
            if (pod.verdict or pod.suspected_at) and not pod.probing and pod.next_probe_at <= now:
                pod.probing = True
                patient = pod.verdict is not None or pod.second_look
                timeout = settings.probe_timeout_s if patient else settings.confirm_timeout_s
                due.append((key, pod.model, timeout))
        return due

    def probe_timeout_s(self) -> float:
        """How long a probe's answer may take to begin (and a judged pod's, to end)."""
        config = self._configured
        return (config.verdicts if config is not None else VerdictsConfig()).probe_timeout_s

    def next_probe_at(self) -> float | None:
        """When the next probe is due (None: no pod is judged or suspected)."""
        times = [
            p.next_probe_at
            for p in self._pods.values()
            if (p.verdict or p.suspected_at) and not p.probing
        ]
        return min(times, default=None)

    def probed(self, key: str, failure: ProbeFailure | None) -> None:
        """The probe of pod `key` finished: `failure` says why it failed (None: it served). A
        suspect's probe whose answer began and stopped gets a second look, a probe given
        `probe_timeout_s` to finish (a slow pod's tokens come seconds apart); when that one
        also stops, the pod is stalled, unless the Envoys saw it finish requests while it
        was probed (it serves, slowly: a long prefill, a host short of CPU). A probe whose
        answer never began clears the suspicion: it waited behind a queue (a slow pod's
        requests take long), and a pod that answers nothing at all is out by its scrapes or
        its engine's counters; but a pod with no page since it (re)started (`unpaged`) is
        stalled. One that failed otherwise (a reset, an error status), failing."""
        pod = self._pods.get(key)
        if pod is None:
            return
        pod.probing = False
        if pod.verdict is None and pod.suspected_at is not None:
            self._settle_suspicion(key, pod, failure)
            return
        if pod.verdict is None:
            return
        if failure is None:
            self._lift(key, pod, "a probe completion was served")
            self._changed()
            return
        config = self._configured
        ceiling = config.verdicts.probe_max_interval_s if config is not None else PROBE_FIRST_S
        pod.probe_interval_s = min(2 * pod.probe_interval_s, ceiling)
        pod.next_probe_at = self._clock() + pod.probe_interval_s
        logger.info(
            "Probe of pod %s failed (%s); next in %.0f s.", key, failure, pod.probe_interval_s
        )

    def _settle_suspicion(self, key: str, pod: _Pod, failure: ProbeFailure | None) -> None:
        """A suspect's probe came back (`probed`): a second look, cleared, or judged."""
        assert pod.suspected_at is not None
        finished_since = pod.quiet_since > pod.suspected_at
        now = self._clock()
        timed_out = failure is not None and failure.timed_out
        began = failure is not None and failure.started
        if timed_out and began and not finished_since and not pod.second_look:
            if self._slower_than_peers(pod, now):
                # Begun and stopped: a second look, given `probe_timeout_s` to finish.
                pod.second_look, pod.next_probe_at = True, now
                return
        pod.suspected_at, pod.second_look = None, False
        queued = not began and not self._unpaged(key)
        if failure is None or (timed_out and (finished_since or queued)):
            pod.owed, pod.quiet_since = 0.0, now
        elif self._may_judge(pod):
            detail = f"{pod.suspicion}; a probe: {failure}"
            self._make(key, pod, "stalled" if failure.timed_out else "failing", now, detail)
            self._changed()

    # -- queries ----------------------------------------------------------------------------

    def _by_pool(self) -> dict[str, tuple[dict[str, str], dict[str, int]]]:
        """Per pool, its judged pods (reason) and its slow ones (steps): made once per
        revision, not per pool asked (a hundred pools of a fleet read them per decision)."""
        if self._views is None or self._views[0] != self.revision:
            views: dict[str, tuple[dict[str, str], dict[str, int]]] = {}
            for key, pod in sorted(self._pods.items()):
                if pod.verdict is not None or pod.slow_steps:
                    judged, slow = views.setdefault(pod.pool, ({}, {}))
                    if pod.verdict is not None:
                        judged[key] = pod.verdict.reason
                    if pod.slow_steps:
                        slow[key] = pod.slow_steps
            self._views = (self.revision, views)
        return self._views[1]

    def slowness_of_pool(self, pool: str) -> dict[str, int]:
        """The pods of `pool` slower than their peers: endpoint id -> steps (1 and up)."""
        return dict(self._by_pool().get(pool, ({}, {}))[1])

    def of_pool(self, pool: str) -> dict[str, str]:
        """The judged pods of `pool`: endpoint id -> reason."""
        return dict(self._by_pool().get(pool, ({}, {}))[0])

    def to_json(self) -> list[dict[str, object]]:
        """For /debug: every judged pod, why and since when."""
        now = self._clock()
        return [
            {
                "pod": key,
                "pool": pod.pool,
                "verdict": pod.verdict.reason,
                "detail": pod.verdict.detail,
                "for_s": round(now - pod.verdict.since, 3),
                "next_probe_in_s": None if pod.probing else round(pod.next_probe_at - now, 3),
            }
            for key, pod in sorted(self._pods.items())
            if pod.verdict is not None
        ]


# host, port, model, timeout -> None when served, else why not (sources/probe.py).
Probe = Callable[..., Awaitable[ProbeFailure | None]]


async def run_probes(
    verdicts: PodVerdicts, wake: asyncio.Event, *, clock: Clock, probe: Probe = probe_completion
) -> None:
    """Probe each judged pod when its probe is due, for as long as the server runs; `wake`
    is set when a verdict is made (a probe may then be due sooner). Idle while no pod is
    judged: it waits on `wake` alone."""
    running: set[asyncio.Task[None]] = set()

    async def one(key: str, model: str, timeout_s: float) -> None:
        host, _, port = key.rpartition(":")
        first_chunk_s = verdicts.probe_timeout_s()
        try:
            failure = await probe(
                host, int(port), model, timeout_s=timeout_s, first_chunk_s=first_chunk_s
            )
        except Exception as error:  # a probe must never stop the others
            failure = ProbeFailure(f"{type(error).__name__}: {error}")
        verdicts.probed(key, failure)
        wake.set()

    try:
        while True:
            wake.clear()
            for key, model, timeout_s in verdicts.due_probes():
                task = asyncio.create_task(one(key, model, timeout_s), name=f"probe {key}")
                running.add(task)
                task.add_done_callback(running.discard)
            next_at = verdicts.next_probe_at()
            wait = None if next_at is None else max(0.05, next_at - clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
    finally:
        for task in running:
            task.cancel()
