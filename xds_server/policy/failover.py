"""Failover to other clusters, and the way back (pure: no I/O; time is an input).

A pool with `remotes` (config.RemoteConfig: other clusters' gateways) has two EDS
priorities: its own pods at 0, the remotes at 1 (envoy/endpoints.py). This module decides
the *local share*: the part of the pool's traffic its own pods get, the rest going to the
remotes Envoy can use. Envoy does the per-request part (a host ejected after connect
failures counts against priority 0's health at once, and a retry goes to another
priority); this is the slow loop's part, from what only the server sees:

    no HEALTHY local pod                       share 0 at once (failover)
    share 1, saturation >= `saturation`        share halves (shed to the remotes)
    share < 1, saturation >= `back_off_at`     share halves, at most every `step_s`
    share < 1, saturation <= `grow_below`,     share grows by step_s / ramp_s, at most
        no local pod queueing or with a           every `step_s`, once the local pods
        full batch                                have been healthy for `hold_s`
    otherwise                                  share holds

Saturation is the local pods' requests running and waiting over their batch limit
(`batch_limit`, else the hardware class's `flow_control.pod_concurrency`), read from
their metrics: a recovering pool gets more only while its pods show room, so the ramp
never pushes them past their batch. The three thresholds and the hold are the
hysteresis: a pool sheds at 1.5x its batch, takes traffic back below 0.8x, and a pod
that flaps never gets a full share between two failures.

Remotes: one that is not usable gets nothing (UNHEALTHY at priority 1): its server
reports the pool with no healthy pod, or failing over itself (so two clusters never send
each other the same traffic). A remote whose server is not heard from (no peer, or its
last summary too old: the caller passes none) is used blind: its gateway may well serve
without its server, and Envoy's outlier detection and retries judge it. Among
the usable ones each gets its configured weight scaled by its reported headroom (1 -
saturation, at least `min_headroom`), so the least saturated remote gets the most. When no remote
is usable the share is reported as 1 whatever it is: Envoy has nowhere else to send.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from xds_server.config import FailoverConfig, FlowControlConfig, PoolConfig, RemoteConfig
from xds_server.policy.signals import PodSignals
from xds_server.policy.state import Health, PoolState

__all__ = [
    "FailoverMemory",
    "LocalLoad",
    "PoolFailover",
    "PoolSummary",
    "RemoteTarget",
    "RemoteView",
    "plan_pool",
    "pool_saturation",
]

@dataclass(frozen=True, kw_only=True)
class PoolSummary:
    """What a cluster's server tells other clusters of one of its pools (peering)."""

    healthy: int
    endpoints: int
    # Requests running and waiting over the pods' batch limit; None when no pod is healthy.
    saturation: float | None
    capacity: int
    # The pool sends some of its own traffic to remotes now.
    failing_over: bool = False


@dataclass(frozen=True, kw_only=True)
class RemoteView:
    """What the server knows of one remote: its addresses (resolved), whether its peering
    link is up (None: no peer configured; for metrics) and its fresh summary of the pool
    (None: not told, or told too long ago)."""

    addresses: tuple[str, ...]
    linked: bool | None = None
    summary: PoolSummary | None = None


@dataclass(frozen=True, kw_only=True)
class RemoteTarget:
    """One address of a remote at priority 1."""

    remote: str
    address: str
    port: int
    weight: int
    usable: bool
    # The remote's TLS, by name (envoy/clusters.py's transport socket matches); None: plaintext.
    tls_match: str | None = None


@dataclass(frozen=True, kw_only=True)
class PoolFailover:
    """The pool's failover: the local share (1: all local) and its remotes' endpoints."""

    share: float = 1.0
    targets: tuple[RemoteTarget, ...] = ()
    # Why the share is what it is, for /debug and logs.
    reason: str = "local"

    @property
    def usable(self) -> bool:
        return any(t.usable for t in self.targets)

    @property
    def active(self) -> bool:
        """Some of the pool's traffic goes to a remote."""
        return self.usable and self.share < 1.0

    @property
    def remote_share(self) -> float:
        return 1.0 - self.share if self.usable else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "share": self.share,
            "active": self.active,
            "reason": self.reason,
            "remotes": [
                {"remote": t.remote, "address": f"{t.address}:{t.port}", "weight": t.weight,
                 "usable": t.usable}
                for t in self.targets
            ],
        }  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class FailoverMemory:
    """What the failover of one pool remembers between decisions."""

    share: float = 1.0
    # When the pool last had a healthy pod after having none (None: it has none now, or
    # never lost them).
    healthy_since: float | None = None
    # When the share last moved.
    stepped_at: float = -math.inf
    failovers: int = 0


@dataclass(frozen=True, kw_only=True)
class LocalLoad:
    """A pool's own pods as the failover sees them: how many are HEALTHY, their requests
    running and waiting over their batch limits (None: none healthy), those limits
    summed, the fullest pod's ratio, and whether any pod queues."""

    healthy: int = 0
    saturation: float | None = None
    capacity: int = 0
    fullest: float = 0.0
    queueing: bool = False


def pool_saturation(
    pool: PoolConfig,
    state: PoolState | None,
    signals: Mapping[str, PodSignals],
    *,
    flow_control: FlowControlConfig,
) -> LocalLoad:
    """`pool`'s LocalLoad by its HEALTHY pods' metrics (a pod not scraped yet counts as
    idle); each pod's batch limit is `batch_limit`, else its hardware class's
    `pod_concurrency`, else `default_pod_concurrency`."""
    if state is None:
        return LocalLoad()
    healthy = [e for e in state.endpoints if e.health is Health.HEALTHY]
    capacity = 0
    demand = fullest = 0.0
    queueing = False
    for endpoint in healthy:
        batch = pool.batch_limit or flow_control.pod_concurrency.get(
            endpoint.hardware or "", flow_control.default_pod_concurrency
        )
        capacity += batch
        observed = signals.get(endpoint.id)
        if observed is not None and observed.scraped:
            held = max(0.0, observed.running) + max(0.0, observed.waiting)
            demand += held
            fullest = max(fullest, held / batch)
            queueing = queueing or observed.waiting > 0
    return LocalLoad(
        healthy=len(healthy),
        saturation=demand / capacity if capacity else None,
        capacity=capacity,
        fullest=fullest,
        queueing=queueing,
    )


def plan_pool(
    pool: PoolConfig,
    state: PoolState | None,
    signals: Mapping[str, PodSignals],
    *,
    remotes: Mapping[str, RemoteView],
    flow_control: FlowControlConfig,
    memory: FailoverMemory,
    now: float,
) -> tuple[PoolFailover, FailoverMemory]:
    """The failover of `pool` now (module docstring), and the memory for the next call.

    `state` is the policy's decision for the pool (None: not decided, taken as all
    healthy: Envoy alone judges it); `remotes` views by remote name."""
    settings = pool.failover
    targets = tuple(
        t for r in pool.remotes for t in _targets(r, remotes.get(r.name), settings)
    )
    if state is None:
        return PoolFailover(targets=targets), memory
    local = pool_saturation(pool, state, signals, flow_control=flow_control)
    if local.healthy == 0:
        share, since, reason = 0.0, None, "no healthy local pod"
    else:
        share, since, reason = _next_share(settings, memory, local, now=now)
    stepped = now if share != memory.share else memory.stepped_at
    failovers = memory.failovers + (1 if memory.share >= 1.0 > share else 0)
    failover = PoolFailover(share=share, targets=targets, reason=reason)
    return failover, FailoverMemory(
        share=share, healthy_since=since, stepped_at=stepped, failovers=failovers
    )


def _next_share(
    settings: FailoverConfig, memory: FailoverMemory, local: LocalLoad, *, now: float
) -> tuple[float, float | None, str]:
    """(share, healthy since, reason) of a pool with a healthy pod (module docstring)."""
    share, since, load = memory.share, memory.healthy_since, local.saturation or 0.0
    if share >= 1.0:
        if load >= settings.saturation:
            return max(settings.min_share, share / 2), None, f"saturation {load:.2f}"
        return share, None, "local"
    if since is None:
        since = now
    due = now - memory.stepped_at >= settings.step_s
    if now - since < settings.hold_s:
        return share, since, "local pods recovering"
    if due and share > 0 and load >= settings.back_off_at:
        return max(settings.min_share, share / 2), since, f"backing off at {load:.2f}"
    room = load <= settings.grow_below and local.fullest < settings.back_off_at
    if due and room and not local.queueing:
        grown = min(1.0, share + settings.step_s / settings.ramp_s)
        return grown, None if grown >= 1.0 else since, f"ramping up at {load:.2f}"
    return share, since, f"holding at {load:.2f}"


def _targets(
    remote: RemoteConfig, view: RemoteView | None, settings: FailoverConfig
) -> list[RemoteTarget]:
    if view is None:
        return []
    usable = True
    weight = float(remote.weight)
    summary = view.summary
    if summary is not None:
        if summary.healthy == 0 or summary.failing_over:
            usable = False
        elif summary.saturation is not None:
            weight *= max(settings.min_headroom, 1.0 - summary.saturation)
    return [
        RemoteTarget(
            remote=remote.name,
            address=address,
            port=remote.port,
            weight=max(1, round(weight)),
            usable=usable,
            tls_match=remote.name if remote.tls is not None else None,
        )
        for address in sorted(set(view.addresses))
    ]
