"""This replica's links to its peers: the latest report of each, kept for the policy.

One task per peer watches its `Peering/Watch` stream (service.py) and keeps the latest
report, over mutual TLS when `credentials` are given (this replica's own certificate).
The stream ending, failing, or bringing a report that does not parse marks the
peer down, is logged and counted, and the link retries along `backoff_s`.

What a peer that went quiet still counts for (the safe side; docs/flow-control.md, Server replicas):
its last report stays, so its Envoys keep the load they last had in every replica's split
until they show up somewhere else (an Envoy whose replica died reconnects to a survivor,
whose own view of it then wins); a peer never heard from holds back an equal part of
every budget for the Envoys it may have (`reserved`). A peer removed from the set (its pod
is gone) is forgotten at once.

Replica links also take each peer's session keys (those its own Envoys logged; reports
carry them only when they changed), and `session_keys` adds them up per pool, so that
every replica places a pool's keys from all the keys the fleet's Envoys logged. A quiet
peer's last keys stay, as its load does, until it leaves the set. One replica places for
all (`followed_homes`): the one whose name sorts first among those up, whose key homes
the others take, so that every replica's Envoys send a key to the same pod.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc
import pydantic
from prometheus_client import CollectorRegistry, Counter, Gauge

from xds_server.clock import Clock, loop_clock
from xds_server.peering.reports import MAX_REPORT_BYTES, ReplicaReport, SessionKeysReport
from xds_server.peering.service import KEYS_HELLO, POOLS_HELLO, WATCH_METHOD
from xds_server.policy.buckets import FollowedBuckets

__all__ = ["PeerLinks", "PeerState"]

logger = logging.getLogger(__name__)


@dataclass
class PeerState:
    """What this replica knows of one peer (mutable; updated by its link)."""

    address: str
    report: ReplicaReport | None = None
    # Clock time the latest report arrived.
    received_at: float | None = None
    connected: bool = False
    failures: int = 0
    last_error: str | None = None
    # The session keys its own Envoys logged, as last sent.
    session_keys: SessionKeysReport | None = None


_NOT_FOLLOWING: Mapping[str, Mapping[str, float]] = MappingProxyType({})
_NOT_FOLLOWING_BUCKETS: Mapping[str, FollowedBuckets] = MappingProxyType({})


def _identity(data: bytes) -> bytes:
    return data


class PeerLinks:
    """Links to every peer in the set `set_peers` was last given: the server's replicas,
    or with `pools` the servers of other clusters, asked for their per-pool summaries
    (service.py; metrics then under another `metric_prefix`).

    Mutable state: `_peers` (address -> PeerState) and `_tasks` (address -> its link
    task). Runs on the event loop. `on_change` is called whenever a peer's report arrives,
    or a peer is added, lost or removed.
    """

    def __init__(
        self,
        *,
        replica: str,
        registry: CollectorRegistry,
        on_change: Callable[[], None] | None = None,
        clock: Clock = loop_clock,
        quiet_s: float = 1.0,
        backoff_s: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0),
        credentials: Callable[[], grpc.ChannelCredentials] | None = None,
        server_name: str | None = None,
        pools: bool = False,
        metric_prefix: str = "xds_peer",
    ) -> None:
        self._replica = replica
        self._hello = replica.encode() + (POOLS_HELLO if pools else KEYS_HELLO)
        self._credentials = credentials
        self._server_name = server_name
        self._on_change = on_change
        self._clock = clock
        self._quiet_s = quiet_s
        self._backoff_s = backoff_s
        self._peers: dict[str, PeerState] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # The reports the peers' served-by was merged from, and it.
        self._served_by: tuple[tuple[SessionKeysReport, ...], Mapping[str, Mapping[int, str]]] = (
            (),
            MappingProxyType({}),
        )
        # The leader's session keys report its followed buckets were read from, and them.
        self._buckets_of: tuple[SessionKeysReport | None, Mapping[str, FollowedBuckets]] = (
            None,
            _NOT_FOLLOWING_BUCKETS,
        )
        self._keys_added: tuple[
            tuple[SessionKeysReport, ...], Mapping[str, Mapping[int, float]]
        ] = (
            (),
            MappingProxyType({}),
        )
        self._up = Gauge(
            f"{metric_prefix}_up",
            "1 while the peer's load stream is open and heard from within a second.",
            ["peer"],
            registry=registry,
        )
        self._reports = Counter(
            f"{metric_prefix}_reports",
            "Load reports received from peer replicas.",
            registry=registry,
        )
        if not pools:  # other clusters' servers take no part in this cluster's budgets
            Gauge(
                f"{metric_prefix}_reserved_ratio",
                "The part of every budget held back for peers never heard from.",
                registry=registry,
            ).set_function(self.reserved)
        self._errors = Counter(
            f"{metric_prefix}_errors",
            "Peer links that failed, by reason (unreachable, invalid report).",
            ["reason"],
            registry=registry,
        )

    def subscribe(self, on_change: Callable[[], None]) -> None:
        """Call `on_change` when what the peers report changes (one listener: the
        controller, built after this)."""
        self._on_change = on_change

    # -- the peer set ----------------------------------------------------------------------

    def set_peers(self, addresses: Iterable[str]) -> None:
        """Link to exactly `addresses` ("host:port"): new ones are watched, those left out
        are forgotten with their reports."""
        wanted = set(addresses)
        for address in sorted(self._peers.keys() - wanted):
            logger.info("Peer %s left the peer set; its Envoys' load is forgotten.", address)
            self._tasks.pop(address).cancel()
            del self._peers[address]
            self._up.remove(address)
        for address in sorted(wanted - self._peers.keys()):
            logger.info("Peer %s joined the peer set.", address)
            state = PeerState(address=address)
            self._peers[address] = state
            self._up.labels(address).set_function(functools.partial(self._is_up, state))
            self._tasks[address] = asyncio.create_task(self._link(state), name=f"peer {address}")
        self._changed()

    async def close(self) -> None:
        """Stop every link."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    # -- what the policy reads -------------------------------------------------------------

    def reports(self) -> list[tuple[ReplicaReport, float]]:
        """Every peer's latest report with the clock time it arrived, newest first."""
        known = [
            (p.report, p.received_at)
            for p in self._peers.values()
            if p.report is not None and p.received_at is not None
        ]
        return sorted(known, key=lambda pair: (-pair[1], pair[0].replica))

    def reserved(self) -> float:
        """The part of every budget held back for peers never heard from: each of them
        might have as many Envoys as this replica and every other (1 / replicas each)."""
        peers = list(self._peers.values())  # a copy: /metrics reads this from a thread
        unseen = sum(1 for p in peers if p.report is None)
        return unseen / (len(peers) + 1)

    def session_keys(self) -> Mapping[str, Mapping[int, float]]:
        """Per pool, each session key hash's decayed count over every peer's own Envoys:
        the same object while no peer sent new keys."""
        reports = self._key_reports()
        if not _same(reports, self._keys_added[0]):
            added: dict[str, dict[int, float]] = {}
            for report in reports:
                for pool, keys in report.pools.items():
                    counts = added.setdefault(pool, {})
                    for hashed, count in keys:
                        counts[hashed] = counts.get(hashed, 0.0) + count
            frozen = MappingProxyType({p: MappingProxyType(c) for p, c in added.items()})
            self._keys_added = (reports, frozen)
        return self._keys_added[1]

    def served_by(self) -> Mapping[str, Mapping[int, str]]:
        """Per pool, the pod each key its peers' Envoys logged was last served by (the peer
        whose address sorts first wins a key both logged): the same object while no peer
        sent new keys."""
        reports = self._key_reports()
        if not _same(reports, self._served_by[0]):
            merged: dict[str, dict[int, str]] = {}
            for report in reversed(reports):
                for pool, served in report.served_by.items():
                    merged.setdefault(pool, {}).update(served)
            frozen = MappingProxyType({p: MappingProxyType(s) for p, s in merged.items()})
            self._served_by = (reports, frozen)
        return self._served_by[1]

    def _key_reports(self) -> tuple[SessionKeysReport, ...]:
        """The peers' latest session keys reports, by address."""
        peers = sorted(self._peers.values(), key=lambda p: p.address)
        return tuple(p.session_keys for p in peers if p.session_keys is not None)

    def followed_homes(self) -> Mapping[str, Mapping[str, float]]:
        """The key homes this replica takes (per session pool, each endpoint's ring-weight
        factor): those of the replica that places for all, the one whose name sorts first
        among this one and its peers that are up and send keys; empty when that is this
        one. The same object while the leader's report is."""
        leader = self._leader()
        if leader is None or leader.session_keys is None:
            return _NOT_FOLLOWING
        return leader.session_keys.factors

    def _leader(self) -> PeerState | None:
        """The peer this replica follows for key homes: the one whose name sorts first
        among this one and its peers that are up and send keys; None when that is this
        one."""
        up = [
            p
            for p in self._peers.values()
            if p.session_keys is not None and p.report is not None and self._is_up(p)
        ]
        leader = min(up, key=lambda p: p.report.replica if p.report else "", default=None)
        if leader is None or leader.report is None or leader.report.replica >= self._replica:
            return None
        return leader

    def followed_buckets(self) -> Mapping[str, FollowedBuckets]:
        """The key buckets this replica takes (per pool that keeps them): those of the
        replica it follows for key homes (`followed_homes`); empty when it keeps its own.
        The same object while the leader's report is."""
        leader = self._leader()
        report = leader.session_keys if leader is not None else None
        if report is None:
            return _NOT_FOLLOWING_BUCKETS
        if self._buckets_of[0] is not report:
            self._buckets_of = (
                report,
                MappingProxyType(
                    {
                        pool: FollowedBuckets(
                            buckets=MappingProxyType(dict(held)),
                            spares=frozenset(report.spares.get(pool, ())),
                        )
                        for pool, held in report.buckets.items()
                    }
                ),
            )
        return self._buckets_of[1]

    def is_up(self, address: str) -> bool:
        """The link to `address` is open and was heard from lately."""
        state = self._peers.get(address)
        return state is not None and bool(self._is_up(state))

    def report_of(self, address: str) -> tuple[ReplicaReport, float] | None:
        """The latest report of the peer at `address` with the clock time it came."""
        state = self._peers.get(address)
        if state is None or state.report is None or state.received_at is None:
            return None
        return state.report, state.received_at

    def _is_up(self, state: PeerState) -> int:
        received = state.received_at
        quiet = received is None or self._clock() - received > self._quiet_s
        return int(state.connected and not quiet)

    def to_json(self) -> list[dict[str, object]]:
        """For /debug/nodes: each peer, whether it is up, the Envoys it reports and how
        many session keys they logged."""
        now = self._clock()
        return [
            {
                "address": p.address,
                "replica": p.report.replica if p.report is not None else None,
                "up": bool(self._is_up(p)),
                "age_s": round(now - p.received_at, 3) if p.received_at is not None else None,
                "failures": p.failures,
                "last_error": p.last_error,
                "envoys": sorted(e.node_id for e in p.report.envoys) if p.report else [],
                # Per pool, how many session keys its own Envoys logged (as last sent).
                "session_keys": {pool: len(keys) for pool, keys in p.session_keys.pools.items()}
                if p.session_keys is not None
                else {},
            }
            for p in sorted(self._peers.values(), key=lambda p: p.address)
        ]

    # -- one link --------------------------------------------------------------------------

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    async def _link(self, state: PeerState) -> None:
        """Watch `state.address` until cancelled, reconnecting along `backoff_s`."""
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_REPORT_BYTES)]
        if self._server_name is not None:
            options.append(("grpc.ssl_target_name_override", self._server_name))
        while True:
            channel = (
                grpc.aio.insecure_channel(state.address, options=options)
                if self._credentials is None
                # Credentials read anew per connection: a rotated certificate is taken.
                else grpc.aio.secure_channel(state.address, self._credentials(), options=options)
            )
            async with channel:
                watch = channel.unary_stream(
                    WATCH_METHOD, request_serializer=_identity, response_deserializer=_identity
                )
                reason = await self._follow(state, watch(self._hello))
            state.connected = False
            state.failures += 1
            self._errors.labels(reason).inc()
            if state.failures == 1:
                logger.warning(
                    "Peer %s: %s. Its Envoys keep the load it last reported; retrying.",
                    state.address,
                    state.last_error,
                )
            self._changed()
            rung = self._backoff_s[min(state.failures, len(self._backoff_s)) - 1]
            await asyncio.sleep(rung)

    async def _follow(self, state: PeerState, call: Any) -> str:
        """Keep `state` up to date from one open `call`; returns why it ended."""
        try:
            async for body in call:
                report = ReplicaReport.model_validate_json(body)
                if not state.connected:
                    logger.info("Peer %s (replica %r) linked.", state.address, report.replica)
                state.connected = True
                state.failures = 0
                state.report, state.received_at = report, self._clock()
                if report.session_keys is not None:
                    state.session_keys = report.session_keys
                self._reports.inc()
                self._changed()
            state.last_error = "the load stream ended"
            return "ended"
        except pydantic.ValidationError as exc:
            call.cancel()
            state.last_error = f"a report that is not valid ({exc.error_count()} errors)"
            return "invalid_report"
        except grpc.aio.AioRpcError as exc:
            state.last_error = f"{exc.code().name}: {exc.details()}"
            return "unreachable"


def _same(reports: tuple[SessionKeysReport, ...], last: tuple[SessionKeysReport, ...]) -> bool:
    """Whether `reports` are the very reports `last` held (so what was made of them holds)."""
    return len(reports) == len(last) and all(a is b for a, b in zip(reports, last, strict=True))
