"""Acceptance: grpcio's own xDS client (proxyless gRPC) is served by our ADS server.

A subprocess bootstrapped at the in-process ADS server opens `xds:///svc`; gRPC's xDS client
fetches the api_listener, its RouteConfiguration, the EDS cluster and its
ClusterLoadAssignment over one SotW ADS stream, and routes a real call to a loopback backend.
A new snapshot that moves the endpoint then moves the traffic.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.xds import fixtures
from tests.xds.conftest import AdsHarness
from tests.xds.grpc_fixtures import (
    NODE_CLUSTER,
    NODE_ID,
    Backend,
    XdsClientProcess,
    grpc_snapshot,
    start_backend,
)
from xds_server.xds.nodes import StreamRecord
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

LISTENER = "svc"
CLUSTER = "pool"
TEST_BUDGET = 20.0


@pytest.fixture
async def backends() -> AsyncIterator[tuple[Backend, Backend]]:
    one = await start_backend("one")
    two = await start_backend("two")
    try:
        yield one, two
    finally:
        await one.stop()
        await two.stop()


@pytest.fixture
async def xds_client(ads: AdsHarness, tmp_path: Path) -> AsyncIterator[XdsClientProcess]:
    client = await XdsClientProcess.start(ads.target, LISTENER, stderr_path=tmp_path / "client.log")
    try:
        yield client
    finally:
        await client.close()


def grpc_record(ads: AdsHarness) -> StreamRecord | None:
    return next((r for r in ads.registry.streams() if r.node_id == NODE_ID), None)


async def wait_for_record(
    ads: AdsHarness, condition: Callable[[StreamRecord], bool], *, seconds: float = 5.0
) -> StreamRecord:
    """Poll the registry until the gRPC client's stream record satisfies `condition`."""
    deadline = time.monotonic() + seconds
    while True:
        record = grpc_record(ads)
        if record is not None and condition(record):
            return record
        if time.monotonic() > deadline:
            state = None if record is None else record.to_json()
            raise AssertionError(f"gRPC client's stream never got there; record: {state}")
        await asyncio.sleep(0.05)


async def call_until_ok(client: XdsClientProcess, *, seconds: float) -> dict[str, Any]:
    """Call with short deadlines until one succeeds; return the last result either way."""
    deadline = time.monotonic() + seconds
    while True:
        result = await client.call(rpc_timeout=1.0)
        if result["ok"] or time.monotonic() > deadline:
            return result


def short_versions(snapshot: Snapshot) -> dict[str, str]:
    """A snapshot's versions keyed as the registry keys them (lds, rds, cds, eds).

    gRPC's xDS client has no runtime: it never asks for RTDS.
    """
    return {t.short: v for t, v in snapshot.versions.items() if t is not ResourceType.RUNTIME}


async def test_grpc_xds_client_routes_through_ads_and_follows_endpoint_moves(
    ads: AdsHarness, backends: tuple[Backend, Backend], xds_client: XdsClientProcess
) -> None:
    one, two = backends
    async with asyncio.timeout(TEST_BUDGET):
        first = grpc_snapshot(LISTENER, CLUSTER, [one.port])
        ads.cache.set_snapshot(first)

        # Part 1: the call resolves through LDS -> RDS -> CDS -> EDS and reaches backend one.
        result = await xds_client.call(rpc_timeout=5.0)
        assert result == {"ok": True, "backend": "one"}, (
            f"{result}; registry: {ads.registry.to_json()}\nclient log:\n{xds_client.stderr_tail()}"
        )
        assert one.hits == 1 and two.hits == 0

        expected = short_versions(first)
        record = await wait_for_record(ads, lambda r: r.acked == expected)
        assert record.protocol == "sotw"
        assert record.node_cluster == NODE_CLUSTER
        assert record.nacks == 0 and record.last_nack is None
        assert record.sent == expected

        # Part 2: move the endpoint to backend two; only EDS changes.
        second = grpc_snapshot(LISTENER, CLUSTER, [two.port])
        assert {t for t in ResourceType if first.versions[t] != second.versions[t]} == {
            ResourceType.ENDPOINT
        }
        assert ads.cache.set_snapshot(second)

        deadline = time.monotonic() + 10.0
        while True:
            result = await xds_client.call(rpc_timeout=2.0)
            assert result["ok"], f"{result}\nclient log:\n{xds_client.stderr_tail()}"
            if result["backend"] == "two":
                break
            assert time.monotonic() < deadline, "traffic never moved to backend two"
            await asyncio.sleep(0.05)

        # Once moved, it stays moved: backend one is no longer an endpoint.
        hits_on_one = one.hits
        for _ in range(5):
            assert await xds_client.call(rpc_timeout=2.0) == {"ok": True, "backend": "two"}
        assert one.hits == hits_on_one

        record = await wait_for_record(ads, lambda r: r.acked == short_versions(second))
        assert record.nacks == 0
        assert ads.metric("xds_nacks_total", type="eds") == 0


async def test_grpc_nack_is_recorded_and_the_next_snapshot_recovers(
    ads: AdsHarness, backends: tuple[Backend, Backend], xds_client: XdsClientProcess
) -> None:
    """gRPC is stricter than Envoy: an HCM router filter without typed_config is NACKed."""
    one, _ = backends
    async with asyncio.timeout(TEST_BUDGET):
        # The protocol tests' Envoy-style listener: its router filter has no typed_config.
        envoy_style = grpc_snapshot(
            LISTENER, CLUSTER, [one.port], make_listener=fixtures.api_listener
        )
        ads.cache.set_snapshot(envoy_style)

        # The first call opens the ADS stream; it cannot succeed without a listener.
        failed = await xds_client.call(rpc_timeout=0.5)
        assert not failed["ok"]

        record = await wait_for_record(ads, lambda r: r.last_nack is not None)
        assert record.last_nack is not None
        assert record.last_nack.type == "lds"
        assert record.last_nack.version == envoy_style.versions[ResourceType.LISTENER]
        assert "typed_config" in record.last_nack.error
        assert "lds" not in record.acked
        assert ads.metric("xds_nacks_total", type="lds") == 1

        # The corrected listener is the next change: it is sent and ACKed (all four types)...
        fixed = grpc_snapshot(LISTENER, CLUSTER, [one.port])
        ads.cache.set_snapshot(fixed)
        record = await wait_for_record(ads, lambda r: r.acked == short_versions(fixed))
        assert record.nacks == 1

        # ...and serves traffic. Poll: a wait_for_ready call started while gRPC's channel is
        # in TRANSIENT_FAILURE, just as the good config lands, can stay queued until its
        # deadline (a gRPC client race, not the server's: everything is ACKed by now).
        result = await call_until_ok(xds_client, seconds=10.0)
        assert result == {"ok": True, "backend": "one"}, (
            f"{result}\nclient log:\n{xds_client.stderr_tail()}"
        )
