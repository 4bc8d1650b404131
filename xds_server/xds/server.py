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
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from xds_server.xds.cache import SnapshotCache
from xds_server.xds.delta import DeltaStream
from xds_server.xds.nodes import NodeRegistry
from xds_server.xds.sotw import SotwStream

__all__ = ["ADS_SERVICE", "AdsServer"]

logger = logging.getLogger(__name__)

ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"

_Request = discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest


class _Wake(enum.Enum):
    SNAPSHOT = "snapshot changed"
    END = "client closed the stream"


def _identity(payload: bytes) -> bytes:
    return payload


class AdsServer:
    """Serves one SnapshotCache over ADS, both SotW and Delta, recording nodes in a registry."""

    def __init__(self, *, cache: SnapshotCache, registry: NodeRegistry) -> None:
        self._cache = cache
        self._registry = registry

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
        self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext[Any, Any]
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
        record, observer = self._registry.open(protocol=protocol, peer=context.peer())
        stream: SotwStream | DeltaStream = (
            SotwStream(stream_id=record.stream_id, observer=observer)
            if protocol == "sotw"
            else DeltaStream(stream_id=record.stream_id, observer=observer)
        )
        events: asyncio.Queue[_Request | _Wake] = asyncio.Queue()
        wake_pending = False

        def wake() -> None:
            nonlocal wake_pending
            if not wake_pending:
                wake_pending = True
                events.put_nowait(_Wake.SNAPSHOT)

        async def read() -> None:
            try:
                async for request in requests:
                    events.put_nowait(request)
            except (grpc.RpcError, asyncio.CancelledError):
                pass
            finally:
                events.put_nowait(_Wake.END)

        reader = asyncio.create_task(read(), name=f"ads-reader-{record.stream_id}")
        cancel_watch = None
        logger.info("ADS %s stream %d opened by %s.", protocol, record.stream_id, record.peer)
        try:
            while True:
                event = await events.get()
                if event is _Wake.END:
                    break
                if event is _Wake.SNAPSHOT:
                    wake_pending = False
                    entry = self._cache.entry_for(record.group)
                    responses = [] if entry is None else stream.set_snapshot(entry.snapshot, born=entry.born)
                else:
                    assert not isinstance(event, _Wake)
                    if cancel_watch is None:
                        if event.HasField("node"):
                            observer.on_node(event.node)
                            record.group = self._cache.group_of(event.node)
                        logger.info(
                            "Node %r (cluster %r) identified on ADS %s stream %d; serving group %r.",
                            record.node_id, record.node_cluster, protocol, record.stream_id, record.group,
                        )
                        cancel_watch = self._cache.watch(record.group, wake)
                        entry = self._cache.entry_for(record.group)
                        if entry is not None:
                            stream.set_snapshot(entry.snapshot, born=entry.born)
                    responses = stream.receive(event)  # type: ignore[arg-type]
                for response in responses:
                    yield response.payload
        finally:
            reader.cancel()
            if cancel_watch is not None:
                cancel_watch()
            self._registry.close(record)
            logger.info("ADS %s stream %d of node %r closed.", protocol, record.stream_id, record.node_id)
