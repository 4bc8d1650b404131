"""Links to peer replicas over real gRPC on loopback: reports arrive, a bad one is refused
and counted, a peer never heard from holds back its part of the budget, a dead peer's last
report is kept, a peer removed from the set is forgotten, and peers' session keys are
added up."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pydantic
import pytest
from prometheus_client import CollectorRegistry

from tests.e2e.conftest import eventually
from xds_server.peering.links import PeerLinks
from xds_server.peering.reports import (
    MAX_SESSION_KEYS,
    ClusterReport,
    EnvoyReport,
    ReplicaReport,
    SessionKeysReport,
)
from xds_server.peering.service import KEYS_HELLO, PEERING_SERVICE, WATCH_METHOD, PeeringServer
from xds_testbed.server_process import free_port

REPORT = ReplicaReport(
    replica="b",
    envoys=(
        EnvoyReport(
            node_id="envoy-2",
            reports_load=True,
            clusters={"pool/standard": ClusterReport(in_progress=3, issued_per_s=2.5)},
        ),
    ),
)


async def _serve(handler: grpc.GenericRpcHandler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _garbage_handler() -> grpc.GenericRpcHandler:
    async def watch(_: bytes, __: Any) -> AsyncIterator[bytes]:
        negative = {"node_id": "e", "clusters": {"c": {"in_progress": -5}}}
        yield json.dumps({"replica": "x", "envoys": [negative]}).encode()
        await asyncio.sleep(3600)

    return grpc.method_handlers_generic_handler(
        PEERING_SERVICE,
        {"Watch": grpc.unary_stream_rpc_method_handler(watch)},
    )


def _counter(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("xds_peer_errors_total", {"reason": reason}) or 0.0


@pytest.fixture
async def links() -> AsyncIterator[tuple[PeerLinks, CollectorRegistry, list[int]]]:
    registry = CollectorRegistry()
    changes: list[int] = []
    peers = PeerLinks(replica="a", registry=registry, on_change=lambda: changes.append(1))
    try:
        yield peers, registry, changes
    finally:
        await peers.close()


async def test_a_peers_reports_arrive_and_outlive_the_peer(
    links: tuple[PeerLinks, CollectorRegistry, list[int]],
) -> None:
    peers, registry, changes = links
    server, address = await _serve(PeeringServer(report=lambda: REPORT).generic_handler())
    try:
        peers.set_peers([address])
        # Never heard from yet: half of every budget (2 replicas) is held back for it.
        assert peers.reserved() == 0.5
        await eventually(lambda: peers.reports(), what="the peer's report")
        [(report, _)] = peers.reports()
        assert report == REPORT and peers.reserved() == 0
        assert registry.get_sample_value("xds_peer_up", {"peer": address}) == 1
        assert changes
    finally:
        await server.stop(None)
    # The peer died: it is down, but its Envoys keep the load it last reported.
    await eventually(
        lambda: registry.get_sample_value("xds_peer_up", {"peer": address}) == 0,
        what="the peer marked down",
    )
    assert [r for r, _ in peers.reports()] == [REPORT]
    assert _counter(registry, "unreachable") + _counter(registry, "ended") >= 1
    # Removed from the set (its pod is gone): forgotten, and nothing is held back.
    peers.set_peers([])
    assert peers.reports() == [] and peers.reserved() == 0
    assert registry.get_sample_value("xds_peer_up", {"peer": address}) is None


async def test_an_unreachable_peer_holds_back_its_part_and_is_counted(
    links: tuple[PeerLinks, CollectorRegistry, list[int]],
) -> None:
    peers, registry, _ = links
    nowhere = f"127.0.0.1:{free_port()}"
    peers.set_peers([nowhere, f"127.0.0.1:{free_port()}"])
    await eventually(lambda: _counter(registry, "unreachable") >= 2, what="both links failing")
    # Three replicas, two never heard from: two thirds of every budget held back.
    assert peers.reserved() == pytest.approx(2 / 3)
    [first, _] = peers.to_json()
    assert first["up"] is False and "UNAVAILABLE" in str(first["last_error"])


async def test_a_report_that_is_not_valid_is_refused_and_counted(
    links: tuple[PeerLinks, CollectorRegistry, list[int]],
) -> None:
    peers, registry, _ = links
    server, address = await _serve(_garbage_handler())
    try:
        peers.set_peers([address])
        await eventually(
            lambda: _counter(registry, "invalid_report") >= 1, what="the bad report refused"
        )
        assert peers.reports() == [] and peers.reserved() == 0.5
    finally:
        await server.stop(None)


async def test_the_service_sends_changes_and_heartbeats_only(
    links: tuple[PeerLinks, CollectorRegistry, list[int]],
) -> None:
    peers, registry, _ = links
    current = [REPORT]
    report: Callable[[], ReplicaReport] = lambda: current[0]  # noqa: E731
    server, address = await _serve(
        PeeringServer(report=report, interval_s=0.01, heartbeat_s=0.5).generic_handler()
    )
    try:
        peers.set_peers([address])
        await eventually(lambda: peers.reports(), what="the first report")
        received = registry.get_sample_value("xds_peer_reports_total") or 0
        # Polled every 10 ms but unchanged: at most a heartbeat or two in 0.6 s.
        await asyncio.sleep(0.6)
        assert (registry.get_sample_value("xds_peer_reports_total") or 0) - received <= 2
        current[0] = ReplicaReport(replica="b")
        await eventually(lambda: peers.reports()[0][0].envoys == (), what="the changed report")
    finally:
        await server.stop(None)


async def test_a_peers_session_keys_come_once_when_they_change_and_are_added_up(
    links: tuple[PeerLinks, CollectorRegistry, list[int]],
) -> None:
    """Two peers' own Envoys logged keys of pool p (one key both): this replica adds them
    up per pool. Keys come in a stream's first report and when they change; reports in
    between leave them standing; the sum is the same object until new keys come."""
    peers, registry, _ = links
    keys = {
        "b": [SessionKeysReport(pools={"p": ((1, 2.0), (7, 1.5))})],
        "c": [SessionKeysReport(pools={"p": ((7, 3.0),), "q": ((9, 1.0),)})],
    }
    load = [REPORT]
    servers = []
    for name in ("b", "c"):
        service = PeeringServer(
            report=lambda: load[0],
            session_keys=functools.partial(lambda n: keys[n][0], name),
            interval_s=0.01,
            heartbeat_s=0.05,
        )
        servers.append(await _serve(service.generic_handler()))
    try:
        peers.set_peers([address for _, address in servers])
        await eventually(lambda: len(peers.session_keys()) == 2, what="both peers' keys")
        added = peers.session_keys()
        assert added == {"p": {1: 2.0, 7: 4.5}, "q": {9: 1.0}}
        shown = sorted((sorted(p["session_keys"].items()) for p in peers.to_json()), key=str)
        assert shown == [[("p", 1), ("q", 1)], [("p", 2)]], "/debug/nodes: keys per pool"
        # Heartbeats and load changes without keys: the keys stand, and the sum is the same.
        received = registry.get_sample_value("xds_peer_reports_total") or 0
        load[0] = ReplicaReport(replica="b")
        await eventually(
            lambda: (registry.get_sample_value("xds_peer_reports_total") or 0) > received + 4,
            what="reports without keys",
        )
        assert peers.session_keys() is added
        keys["b"][0] = SessionKeysReport(pools={"p": ((1, 5.0),)})
        await eventually(lambda: peers.session_keys()["p"].get(1) == 5.0, what="b's new keys")
        assert peers.session_keys() == {"p": {1: 5.0, 7: 3.0}, "q": {9: 1.0}}
    finally:
        for server, _ in servers:
            await server.stop(None)


def test_session_keys_reports_are_bounded() -> None:
    ReplicaReport.model_validate_json(
        json.dumps({"replica": "b", "session_keys": {"pools": {"p": [[2**64 - 1, 1.5]]}}})
    )
    for bad in (
        [[2**64, 1.0]],  # not a 64-bit hash
        [[-1, 1.0]],
        [[3, -1.0]],  # a negative count
        [[i, 1.0] for i in range(MAX_SESSION_KEYS + 1)],  # more keys than a pool keeps
    ):
        with pytest.raises(pydantic.ValidationError):
            ReplicaReport.model_validate_json(
                json.dumps({"replica": "b", "session_keys": {"pools": {"p": bad}}})
            )


async def test_a_replica_that_does_not_ask_for_session_keys_is_sent_none() -> None:
    """A replica that predates session keys says nothing of them in its hello, and would
    refuse a report with a field it does not know: it is sent none."""
    keys = SessionKeysReport(pools={"p": ((1, 2.0),)})
    service = PeeringServer(report=lambda: REPORT, session_keys=lambda: keys)
    server, address = await _serve(service.generic_handler())
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            watch = channel.unary_stream(WATCH_METHOD)
            for hello, sent in ((b"old-replica", False), (b"new-replica" + KEYS_HELLO, True)):
                call = watch(hello)
                first = json.loads(await call.read())
                call.cancel()
                assert ("session_keys" in first) is sent, (hello, first)
    finally:
        await server.stop(None)


async def test_the_replica_whose_name_sorts_first_places_for_all() -> None:
    """Replica "b" follows the key homes of a peer named "a" that is up, not those of one
    named "c"; with no such peer it places its own (an empty mapping)."""
    registry = CollectorRegistry()
    peers = PeerLinks(replica="b", registry=registry)
    factors = {"p": {"10.0.0.1:8000": 0.5}}
    servers = []
    try:
        for name in ("c", "a"):
            service = PeeringServer(
                report=functools.partial(ReplicaReport, replica=name),
                session_keys=functools.partial(
                    SessionKeysReport, factors={"p": {"10.0.0.1:8000": 2.0 if name == "c" else 0.5}}
                ),
                heartbeat_s=0.05,
            )
            servers.append(await _serve(service.generic_handler()))
        peers.set_peers([servers[0][1]])
        await eventually(lambda: peers.reports(), what="c's report")
        await eventually(lambda: peers.to_json()[0]["up"], what="c up")
        assert peers.followed_homes() == {}, "c sorts after b: b places its own"
        peers.set_peers([address for _, address in servers])
        await eventually(lambda: peers.followed_homes() == factors, what="following a")
        await servers[1][0].stop(None)
        await eventually(lambda: peers.followed_homes() == {}, within_s=10, what="a gone quiet")
    finally:
        await peers.close()
        for server, _ in servers:
            await server.stop(None)
