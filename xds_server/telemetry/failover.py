"""Failover to other clusters, per pool and remote, from the latest decision
(policy/failover.py):

    xds_pool_failover_active{pool}        1 while some of the pool's traffic goes to remotes
    xds_pool_failovers_total{pool}        times the pool started sending traffic away
    xds_pool_remote_share_ratio{pool}     the part of its traffic sent to remotes
    xds_remote_up{pool, remote}           1 while the remote can take the pool's traffic

A collector, like pools.py: a pool or remote that goes away leaves no stale series.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from xds_server.policy.failover import FailoverMemory
from xds_server.telemetry.bands import DecisionView

__all__ = ["FailoverCollector", "FailoverView"]


class FailoverView(DecisionView, Protocol):
    """The controller, as seen from here: its decision and each pool's failover memory."""

    @property
    def failover_memory(self) -> Mapping[str, FailoverMemory]: ...


class FailoverCollector(Collector):
    """The four families of the module docstring, one series per pool with remotes of the
    config in force (and per remote)."""

    def __init__(self, view: FailoverView) -> None:
        self._view = view

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        active = GaugeMetricFamily(
            "xds_pool_failover_active",
            "1 while some of the pool's traffic goes to other clusters' gateways, else 0.",
            labels=["pool"],
        )
        failovers = CounterMetricFamily(
            "xds_pool_failovers",
            "Times the pool started sending traffic to other clusters (all local before).",
            labels=["pool"],
        )
        share = GaugeMetricFamily(
            "xds_pool_remote_share_ratio",
            "The part of the pool's traffic the server directs to other clusters (0..1).",
            labels=["pool"],
        )
        up = GaugeMetricFamily(
            "xds_remote_up",
            "1 while the remote can take the pool's traffic (an address known; its server,"
            " when peered, reports the pool healthy and not failing over itself), else 0.",
            labels=["pool", "remote"],
        )
        config = self._view.config
        plans = self._view.decision.failover
        memory = self._view.failover_memory
        for pool in config.pools if config is not None else ():
            if not pool.remotes:
                continue
            plan = plans.get(pool.name)
            active.add_metric([pool.name], float(plan is not None and plan.active))
            share.add_metric([pool.name], plan.remote_share if plan is not None else 0.0)
            told = memory.get(pool.name)
            failovers.add_metric([pool.name], told.failovers if told is not None else 0)
            usable = {t.remote for t in plan.targets if t.usable} if plan is not None else set()
            for remote in pool.remotes:
                up.add_metric([pool.name, remote.name], float(remote.name in usable))
        yield from (active, failovers, share, up)
