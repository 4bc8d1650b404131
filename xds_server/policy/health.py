"""Which pods are in rotation, and why the others are not (docs/failures.md).

- A pod being shut down is DRAINING.
- A pod whose scrapes could not connect at all (refused, reset: `PodSignals.down`) is
  UNHEALTHY at the next decision, and HEALTHY again once a scrape succeeds.
- A pod the Envoys' reports show stalled or failing (verdicts.py), or whose engine ran
  requests and processed no token for `balancing.stall_after_s` by its own counters
  (`stalled_s`), is UNHEALTHY. Engines count a prompt's tokens when its prefill ends, so
  pods known to prefill a long prompt are left out of the counters' rule, and counters
  that show more than `Tuning.max_stalled_share` of the pool stalled are not believed (a
  pool does not wedge all at once; an exporter can).
- A pod with no believed page yet (never scraped, only failures, or a page refused as
  implausible) is UNHEALTHY with the lowest weight: a pod's page is the only thing that
  sizes its weight. So is a pod silent for longer than `stale_after_s` (`silent_s` grows
  only while scrapes are tried, so a stalled server does not take its own silence for the
  pods'), and one whose KV capacity its peers contradict (capacity.py).
- A pod on probation is HEALTHY at a small weight (`Tuning.probation_weight` times the
  median of its pool's: scoring.py): it has given no believed page since it (re)started,
  its page is late (a scrape timed out: an error status or a page refused is no
  probation), and its health check answers (`PodSignals.probation_s`). A real vLLM
  restarted under load answered `/health` at once and `/metrics` ~40 s later, and was out
  of rotation all that time (issue 36): a Ready pod idle beside queueing peers. The small
  share warms its caches and proves it on real requests; it is judged by the Envoys'
  reports like any pod (verdicts.py: a pod that hangs or fails what it is sent is out
  at the next decision, probation or not), and Envoy retries elsewhere what it does not
  begin within `first_byte_s`. Its first believed page ends the probation (then it is
  weighed as any pod); no page within `Tuning.probation_max_s` of its first health answer
  puts it out (`probation_ended`): a page that never comes is an exporter to fix.
- When no pod of a pool that is not down has fresh metrics, `balancing.all_stale`
  decides: fail_open keeps them HEALTHY on their last weights (a metrics outage should
  not become a serving outage), fail_closed marks them UNHEALTHY; a pod known to be down
  never comes back that way.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

from xds_server.config import BalancingConfig, PoolConfig
from xds_server.policy.capacity import unbelieved_capacities
from xds_server.policy.reasons import Reason, ReasonCode
from xds_server.policy.signals import PodSignals, endpoint_id
from xds_server.policy.state import Health
from xds_server.tuning import Tuning

__all__ = ["Rotation", "rotation"]


@dataclass(frozen=True, kw_only=True)
class Rotation:
    """A pool's pods as the health rules see them."""

    # Pods with fresh, believed metrics and not down: the ones scored anew.
    fresh: Mapping[str, PodSignals]
    # Pods on probation (module docstring): in rotation at a small weight.
    probation: Set[str]
    # Pods out of rotation whatever their metrics say (down, stalled, failing).
    down: Set[str]
    # Why the Envoys' reports or the engine's counters took a pod out ("stalled", ...).
    verdicts: Mapping[str, str]
    # Pods whose KV capacity their peers contradict, with their peers' median.
    unbelieved: Mapping[str, float]
    # No pod that is not down has fresh metrics, and the pool fails open.
    fail_open: bool
    # The pods in rotation, in the pool's order.
    healthy: tuple[str, ...]
    # Each endpoint's health, and the reason when it is not plainly HEALTHY.
    health: Mapping[str, tuple[Health, Reason | None]]


def stuck(
    keys: Set[str], signals: Mapping[str, PodSignals], settings: BalancingConfig, tuning: Tuning
) -> dict[str, str]:
    """The pods of `keys` whose engine counters show them stalled (module docstring)."""
    found = {
        key: "stalled"
        for key in keys
        if (s := signals.get(key)) is not None and s.stalled_s >= settings.stall_after_s
    }
    return found if len(found) <= int(len(keys) * tuning.max_stalled_share) else {}


def _out_reason(
    key: str, signals: PodSignals | None, verdicts: Mapping[str, str], counted: Set[str]
) -> Reason:
    """Why a pod known to be down or judged is out of rotation."""
    if signals is not None and signals.down:
        return Reason("down", "its last scrape could not connect")
    verdict = verdicts[key]
    code: ReasonCode = "stalled" if verdict == "stalled" else "failing"
    if key in counted and signals is not None:
        detail = (
            f"engine processed no token for {signals.stalled_s:.1f} s, running {signals.running:g}"
        )
    else:
        detail = f"the Envoys' reports: {verdict}"
    return Reason(code, detail)


def _unrotated_reason(
    key: str,
    signals: PodSignals | None,
    unbelieved: Mapping[str, float],
    stale_after_s: float,
    tuning: Tuning,
) -> Reason:
    """Why a pod that is not down is not in rotation."""
    if signals is not None and signals.probation_s is not None:
        return Reason(
            "probation_ended",
            f"no metrics page {signals.probation_s:.1f} s after its first health answer"
            f" > {tuning.probation_max_s:g} s",
        )
    if signals is None or not signals.scraped:
        return Reason("unscraped", "no believed metrics page yet")
    if key in unbelieved:
        return Reason(
            "capacity_unbelieved",
            f"KV capacity {signals.kv_capacity_tokens} beyond its peers' median"
            f" {unbelieved[key]:g}",
        )
    return Reason("stale", f"silent for {signals.silent_s:.1f} s > {stale_after_s:g} s")


def _probation_reason(signals: PodSignals, tuning: Tuning) -> Reason:
    assert signals.probation_s is not None
    return Reason(
        "probation",
        f"no metrics page since it (re)started, its health check answers:"
        f" {signals.probation_s:.1f} s of {tuning.probation_max_s:g} s at"
        f" {tuning.probation_weight:g}x the median weight",
    )


def _fresh(
    keys: Set[str], signals: Mapping[str, PodSignals], settings: BalancingConfig
) -> dict[str, PodSignals]:
    """The pods of `keys` with a believed page no older than `stale_after_s`, in the
    signals' order."""
    return {
        key: s
        for key, s in signals.items()
        if key in keys and s.scraped and s.silent_s <= settings.stale_after_s
    }


def _on_probation(
    keys: Set[str], signals: Mapping[str, PodSignals], tuning: Tuning
) -> frozenset[str]:
    """The pods of `keys` on probation and within its time (module docstring)."""
    return frozenset(
        key
        for key in keys
        if (s := signals.get(key)) is not None
        and s.probation_s is not None
        and s.probation_s <= tuning.probation_max_s
    )


def rotation(
    pool: PoolConfig,
    signals: Mapping[str, PodSignals],
    settings: BalancingConfig,
    tuning: Tuning,
    *,
    long_prompts: Mapping[str, int],
    verdicts: Mapping[str, str],
    draining: Set[str],
) -> Rotation:
    """The pool's rotation from its pods' `signals`, the Envoys' `verdicts` and the pods
    being shut down (`draining`)."""
    keys = {endpoint_id(e) for e in pool.endpoints}
    counted = stuck(keys - long_prompts.keys(), signals, settings, tuning)
    verdicts = {**counted, **verdicts}
    down = {key for key, s in signals.items() if s.down} | (verdicts.keys() & keys)
    fresh = _fresh(keys - down, signals, settings)
    unbelieved = unbelieved_capacities(pool, fresh, settings, min_peers=tuning.min_capacity_peers)
    for key in unbelieved:
        del fresh[key]
    probation = _on_probation(keys - down - fresh.keys(), signals, tuning)
    all_stale = not fresh and any(endpoint_id(e) not in down for e in pool.endpoints)
    fail_open = all_stale and settings.all_stale == "fail_open"
    health: dict[str, tuple[Health, Reason | None]] = {}
    for endpoint in pool.endpoints:
        key = endpoint_id(endpoint)
        observed = signals.get(key)
        if key in draining:
            health[key] = (Health.DRAINING, Reason("draining", "the pod is being shut down"))
        elif key in down:
            health[key] = (Health.UNHEALTHY, _out_reason(key, observed, verdicts, counted.keys()))
        elif key in fresh:
            health[key] = (Health.HEALTHY, None)
        elif key in probation:
            health[key] = (Health.HEALTHY, _probation_reason(signals[key], tuning))
        elif fail_open:
            reason = Reason("all_stale_fail_open", "no pod of the pool has fresh metrics")
            health[key] = (Health.HEALTHY, reason)
        else:
            reason = _unrotated_reason(key, observed, unbelieved, settings.stale_after_s, tuning)
            health[key] = (Health.UNHEALTHY, reason)
    return Rotation(
        fresh=fresh,
        probation=probation,
        down=down,
        verdicts=verdicts,
        unbelieved=unbelieved,
        fail_open=fail_open,
        healthy=tuple(k for k, (h, _) in health.items() if h is Health.HEALTHY),
        health=health,
    )
