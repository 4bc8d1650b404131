from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from xds_server.telemetry import Telemetry
from xds_server.xds.ads import AdsServer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.nodes import NodeRegistry


@dataclass
class AdsHarness:
    cache: SnapshotCache
    registry: NodeRegistry
    telemetry: Telemetry
    target: str

    def metric(self, name: str, **labels: str) -> float:
        value = self.telemetry.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@pytest.fixture
async def ads() -> AsyncIterator[AdsHarness]:
    telemetry = Telemetry()
    cache = SnapshotCache()
    registry = NodeRegistry(telemetry)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((AdsServer(cache=cache, registry=registry).generic_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield AdsHarness(cache, registry, telemetry, f"127.0.0.1:{port}")
    finally:
        await server.stop(grace=None)


class RawClient:
    """A scripted ADS client: writes requests, reads responses through a queue."""

    def __init__(self, target: str, *, delta: bool = False, node_id: str = "test-node") -> None:
        self.node = base_pb2.Node(id=node_id, cluster="test-cluster")
        self.delta = delta
        self._channel = grpc.aio.insecure_channel(target)
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel)
        self._call: Any = (
            stub.DeltaAggregatedResources() if delta else stub.StreamAggregatedResources()
        )
        self._responses: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for response in self._call:
                self._responses.put_nowait(response)
        except (grpc.RpcError, asyncio.CancelledError):
            pass

    async def send(self, type_url: str, **fields: Any) -> None:
        request_class = (
            discovery_pb2.DeltaDiscoveryRequest if self.delta else discovery_pb2.DiscoveryRequest
        )
        await self._call.write(request_class(node=self.node, type_url=type_url, **fields))

    async def recv(self, within_s: float = 2.0) -> Any:
        return await asyncio.wait_for(self._responses.get(), within_s)

    async def expect_silence(self, seconds: float = 0.3) -> None:
        await asyncio.sleep(seconds)
        assert self._responses.empty(), f"unexpected response: {self._responses.get_nowait()}"

    async def close(self) -> None:
        self._reader.cancel()
        self._call.cancel()
        await self._channel.close()


@pytest.fixture
async def clients(ads: AdsHarness) -> AsyncIterator[Any]:
    made: list[RawClient] = []

    def make(*, delta: bool = False, node_id: str = "test-node") -> RawClient:
        client = RawClient(ads.target, delta=delta, node_id=node_id)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()
