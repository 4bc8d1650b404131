"""The gRPC side of ADS: StreamAggregatedResources (SotW) and DeltaAggregatedResources.

Each stream is one task that takes events from one queue, in order: requests (read by a
reader task) and "snapshot changed" wake-ups (from the cache). The protocol state machine
turns each event into responses; this module only moves bytes. Responses are pre-encoded
(see snapshot.py), so the method handlers use an identity serializer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from xds_server.xds.cache import SnapshotCache
from xds_server.xds.delta import DeltaStream
from xds_server.xds.identity import Authenticator
from xds_server.xds.nodes import NodeRegistry
from xds_server.xds.sotw import SotwStream
from xds_server.xds.stream import Response

__all__ = ["ADS_SERVICE", "AdsServer"]

logger = logging.getLogger(__name__)

ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"

_Request: TypeAlias = discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest


class _Wake(enum.Enum):
    SNAPSHOT = "snapshot changed"
    END = "client closed the stream"


def _identity(payload: bytes) -> bytes:
    return payload


class AdsServer:
    """Serves one SnapshotCache over ADS, both SotW and Delta, recording nodes in a registry."""

    def __init__(
        self,
        *,
        cache: SnapshotCache,
        registry: NodeRegistry,
        authenticator: Authenticator | None = None,
    ) -> None:
        self._cache = cache
        self._registry = registry
        self._authenticator = authenticator

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            ADS_SERVICE,
            {
                "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
                    self._stream_sotw,
                    request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
                    response_serializer=_identity,
                ),
                "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
                    self._stream_delta,
                    request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
                    response_serializer=_identity,
                ),
            },
        )

    # grpc.aio recognises streaming handlers by inspect.isasyncgenfunction: these must yield.
    async def _stream_sotw(
        self,
        requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[bytes]:
        async for payload in self._serve("sotw", requests, context):
            yield payload

    async def _stream_delta(
        self,
        requests: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[bytes]:
        async for payload in self._serve("delta", requests, context):
            yield payload

    async def _serve(
        self,
        protocol: str,
        requests: AsyncIterator[_Request],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[bytes]:
        session = _Session(
            protocol=protocol, peer=context.peer(), cache=self._cache, registry=self._registry
        )

        async def read() -> None:
            try:
                async for request in requests:
                    session.events.put_nowait(request)
            except (grpc.RpcError, asyncio.CancelledError):
                pass
            finally:
                session.events.put_nowait(_Wake.END)

        reader = asyncio.create_task(read(), name=f"ads-reader-{session.record.stream_id}")
        admitted = self._authenticator is None
        try:
            while (event := await session.events.get()) is not _Wake.END:
                if not admitted and not isinstance(event, _Wake):
                    assert self._authenticator is not None
                    await self._authenticator.admit_envoy(
                        context, node_id=event.node.id, service="ads"
                    )
                    admitted = True
                for response in session.handle(event):
                    yield response.payload
        finally:
            reader.cancel()
            session.close()


class _Session:
    """One open stream: its record, its protocol state machine and its event queue.

    Mutable state: the queue, whether a snapshot wake-up is already queued (wake-ups are
    coalesced: the state machine always reads the latest snapshot), and the cache watch.
    """

    def __init__(
        self, *, protocol: str, peer: str, cache: SnapshotCache, registry: NodeRegistry
    ) -> None:
        self._cache = cache
        self._registry = registry
        self.record, self._observer = registry.open(protocol=protocol, peer=peer)
        self.stream: SotwStream | DeltaStream = (
            SotwStream(stream_id=self.record.stream_id, observer=self._observer)
            if protocol == "sotw"
            else DeltaStream(stream_id=self.record.stream_id, observer=self._observer)
        )
        self.events: asyncio.Queue[_Request | _Wake] = asyncio.Queue()
        self._wake_queued = False
        self._cancel_watch: Callable[[], None] | None = None
        logger.info("ADS %s stream %d opened by %s.", protocol, self.record.stream_id, peer)

    def _wake(self) -> None:
        if not self._wake_queued:
            self._wake_queued = True
            self.events.put_nowait(_Wake.SNAPSHOT)

    def handle(self, event: _Request | _Wake) -> list[Response]:
        """The responses `event` makes due, in send order."""
        if event is _Wake.SNAPSHOT:
            self._wake_queued = False
            entry = self._cache.entry_for(self.record.group, self.record.node_id)
            return (
                [] if entry is None else self.stream.set_snapshot(entry.snapshot, born=entry.born)
            )
        assert not isinstance(event, _Wake)
        if self._cancel_watch is None:
            self._identify(event)
        return self.stream.receive(event)

    def _identify(self, first: _Request) -> None:
        """Pick the node's group from its first request, watch it, and adopt its snapshot."""
        record = self.record
        if first.HasField("node"):
            self._observer.on_node(first.node)
            record.group = self._cache.group_of(first.node)
        logger.info(
            "Node %r (cluster %r) identified on ADS %s stream %d; serving group %r.",
            record.node_id, record.node_cluster, record.protocol, record.stream_id, record.group,
        )  # fmt: skip
        self._cancel_watch = self._cache.watch(record.group, self._wake, record.node_id)
        entry = self._cache.entry_for(record.group, record.node_id)
        if entry is not None:
            self.stream.set_snapshot(entry.snapshot, born=entry.born)

    def close(self) -> None:
        if self._cancel_watch is not None:
            self._cancel_watch()
        self._registry.close(self.record)
        logger.info(
            "ADS %s stream %d of node %r closed.",
            self.record.protocol,
            self.record.stream_id,
            self.record.node_id,
        )
