"""Other clusters, as the failover policy sees them: where their gateways are, and what
their servers say of their pools.

Each pool's `remotes` (config.RemoteConfig) name another cluster's gateway, by address
or DNS name (a Kubernetes Service, e.g. `gateway.llm.svc.clusterset.local`), and
optionally its server's peering address. This keeps, for the controller:

- the addresses of every remote named by DNS, looked up every `resolve_interval_s` (and
  at once when the config names a new one), on the event loop's resolver; a lookup that
  fails keeps the last addresses, and is logged and counted;
- a link to every remote server (peering/links.py, over the same mutual TLS as the
  replicas' links), asking for per-pool summaries instead of Envoy load
  (service.POOLS_HELLO): what another cluster says never enters this cluster's budgets.
  A summary older than `summary_max_age_s` is not used (the remote is then used blind).

Nothing new to run: the remote servers already listen for peers on their xDS port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping
from types import MappingProxyType

import grpc
from prometheus_client import CollectorRegistry, Counter

from xds_server.clock import Clock, loop_clock
from xds_server.config import PoolConfig, RemoteConfig, RoutingConfig
from xds_server.peering.links import PeerLinks
from xds_server.peering.reports import PoolReport, ReplicaReport
from xds_server.policy.failover import PoolFailover, PoolSummary, RemoteView, pool_saturation
from xds_server.policy.signals import PodSignals
from xds_server.policy.state import PoolState

__all__ = ["RemoteClusters", "pool_reports"]

logger = logging.getLogger(__name__)


class RemoteClusters:
    """The remotes of every pool: their resolved addresses and their servers' summaries.

    Mutable state: `_names` (the DNS names the config names), `_resolved` (name -> its
    addresses at the last good lookup), `_wake` (a new name to look up) and the links.
    Runs on the event loop; `views` is synchronous and reads only what is kept.
    """

    def __init__(
        self,
        *,
        replica: str,
        registry: CollectorRegistry,
        credentials: Callable[[], grpc.ChannelCredentials] | None = None,
        server_name: str | None = None,
        clock: Clock = loop_clock,
        resolve_interval_s: float = 10.0,
        summary_max_age_s: float = 5.0,
    ) -> None:
        self._clock = clock
        self._resolve_interval_s = resolve_interval_s
        self._summary_max_age_s = summary_max_age_s
        self.links = PeerLinks(
            replica=replica,
            registry=registry,
            clock=clock,
            credentials=credentials,
            server_name=server_name,
            pools=True,
            metric_prefix="xds_remote_peer",
        )
        self._names: frozenset[str] = frozenset()
        self._resolved: dict[str, tuple[str, ...]] = {}
        self._wake = asyncio.Event()
        self._on_change: Callable[[], None] | None = None
        self._resolve_errors = Counter(
            "xds_remote_resolve_errors",
            "DNS lookups of remote gateways that failed (the last addresses are kept).",
            ["remote"],
            registry=registry,
        )

    def subscribe(self, on_change: Callable[[], None]) -> None:
        """Call `on_change` when a remote's addresses or summary change."""
        self._on_change = on_change
        self.links.subscribe(on_change)

    def follow(self, config: RoutingConfig) -> None:
        """Link to the remote servers `config` names and look up its remote DNS names."""
        remotes = [r for p in config.pools for r in p.remotes]
        self.links.set_peers({r.peer for r in remotes if r.peer is not None})
        names = frozenset(r.address for r in remotes if not _is_ip(r.address))
        for gone in self._names - names:
            self._resolved.pop(gone, None)
        if names - self._names:
            self._wake.set()
        self._names = names

    async def run(self) -> None:
        """Look the remotes' DNS names up until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            changed = False
            for name in sorted(self._names):
                try:
                    infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
                except OSError as exc:
                    self._resolve_errors.labels(name).inc()
                    logger.warning(
                        "Remote gateway %s: lookup failed (%s); keeping %s.",
                        name, exc, ", ".join(self._resolved.get(name, ())) or "no address",
                    )  # fmt: skip
                    continue
                addresses = tuple(sorted({str(info[4][0]) for info in infos}))
                if self._resolved.get(name) != addresses and name in self._names:
                    logger.info("Remote gateway %s is at %s.", name, ", ".join(addresses))
                    self._resolved[name] = addresses
                    changed = True
            if changed and self._on_change is not None:
                self._on_change()
            self._wake.clear()
            try:
                async with asyncio.timeout(self._resolve_interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def close(self) -> None:
        await self.links.close()

    def views(self, config: RoutingConfig) -> Mapping[str, Mapping[str, RemoteView]]:
        """Per pool with remotes, per remote: its addresses, link and fresh summary."""
        now = self._clock()
        return MappingProxyType(
            {
                pool.name: {r.name: self._view(pool, r, now) for r in pool.remotes}
                for pool in config.pools
                if pool.remotes
            }
        )

    def _view(self, pool: PoolConfig, remote: RemoteConfig, now: float) -> RemoteView:
        addresses = (
            (remote.address,) if _is_ip(remote.address) else self._resolved.get(remote.address, ())
        )
        if remote.peer is None:
            return RemoteView(addresses=addresses)
        summary = None
        latest = self.links.report_of(remote.peer)
        if latest is not None and now - latest[1] <= self._summary_max_age_s:
            told = (latest[0].pools or {}).get(remote.pool or pool.name)
            if told is not None:
                summary = PoolSummary(
                    healthy=told.healthy,
                    endpoints=told.endpoints,
                    saturation=told.saturation,
                    capacity=told.capacity,
                    failing_over=told.failing_over,
                )
        return RemoteView(
            addresses=addresses, linked=self.links.is_up(remote.peer), summary=summary
        )


def pool_reports(
    config: RoutingConfig,
    *,
    replica: str,
    states: Mapping[str, PoolState],
    failover: Mapping[str, PoolFailover],
    signals: Mapping[str, PodSignals],
) -> ReplicaReport:
    """What other clusters' servers are told of this cluster's pools (those the policy
    decides on: a pool without live metrics has no health or saturation to tell)."""
    pools = {}
    for pool in config.pools:
        state = states.get(pool.name)
        if state is None:
            continue
        local = pool_saturation(pool, state, signals, flow_control=config.flow_control)
        plan = failover.get(pool.name)
        pools[pool.name] = PoolReport(
            healthy=local.healthy,
            endpoints=len(state.endpoints),
            saturation=None if local.saturation is None else round(local.saturation, 3),
            capacity=local.capacity,
            failing_over=plan is not None and plan.share < 1.0,
        )
    return ReplicaReport(replica=replica, pools=pools)


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True
