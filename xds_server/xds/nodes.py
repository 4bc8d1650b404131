"""Which Envoys are connected, what each has accepted, and what each has rejected.

One StreamRecord per open ADS stream, kept up to date by the stream's observer. A NACK is
logged (INFO, naming the node, type, version and Envoy's error) and counted; nothing is
re-sent, so the Envoy keeps serving its last good config until the next change.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2

from xds_server.telemetry import Telemetry
from xds_server.xds.resources import ResourceType
from xds_server.xds.stream import Response, StreamObserver

__all__ = ["NackRecord", "NodeRegistry", "StreamRecord"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NackRecord:
    type: str
    version: str
    error: str
    at: float


@dataclass
class StreamRecord:
    """What is known of one open stream (mutable; updated by its observer)."""

    stream_id: int
    protocol: str
    peer: str
    opened_at: float
    node_id: str = ""
    node_cluster: str = ""
    group: str = ""
    acked: dict[str, str] = field(default_factory=dict)
    sent: dict[str, str] = field(default_factory=dict)
    responses: int = 0
    nacks: int = 0
    last_nack: NackRecord | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "stream_id": self.stream_id,
            "protocol": self.protocol,
            "peer": self.peer,
            "opened_at": self.opened_at,
            "node_id": self.node_id,
            "node_cluster": self.node_cluster,
            "group": self.group,
            "acked_versions": dict(self.acked),
            "sent_versions": dict(self.sent),
            "responses": self.responses,
            "nacks": self.nacks,
            "last_nack": None if self.last_nack is None else vars(self.last_nack),
        }


class _RecordingObserver:
    """The StreamObserver of one stream: updates its record, the metrics and the log."""

    def __init__(
        self,
        record: StreamRecord,
        telemetry: Telemetry,
        on_ack: Callable[[], None],
        on_node: Callable[[str], None],
        on_nack: Callable[[str, ResourceType, str], None],
    ) -> None:
        self._record = record
        self._telemetry = telemetry
        self._notify_ack = on_ack
        self._notify_node = on_node
        self._notify_nack = on_nack

    def on_node(self, node: base_pb2.Node) -> None:
        self._record.node_id, self._record.node_cluster = node.id, node.cluster
        self._notify_node(node.id)

    def on_sent(self, response: Response) -> None:
        t = response.type.short
        self._record.sent[t] = response.version
        self._record.responses += 1
        self._telemetry.responses.labels(t).inc()
        self._telemetry.resources_sent.labels(t).inc(len(response.resource_names))
        logger.debug(
            "Sent %s version %s (%d resources, %d removed) to node %r on stream %d, nonce %s.",
            t,
            response.version,
            len(response.resource_names),
            len(response.removed),
            self._record.node_id,
            self._record.stream_id,
            response.nonce,
        )

    def on_ack(self, response: Response) -> None:
        t = response.type.short
        self._record.acked[t] = response.version
        self._telemetry.acks.labels(t).inc()
        if response.snapshot_born:
            self._telemetry.push_duration.labels(t).observe(
                time.monotonic() - response.snapshot_born
            )
        self._notify_ack()

    def on_nack(self, response: Response, error: str) -> None:
        t = response.type.short
        self._record.nacks += 1
        self._record.last_nack = NackRecord(
            type=t, version=response.version, error=error, at=time.time()
        )
        self._telemetry.nacks.labels(t).inc()
        logger.warning(
            "Node %r rejected %s version %s (stream %d): %s. It keeps its previous %s config;"
            " the server sends again on the next change.",
            self._record.node_id,
            t,
            response.version,
            self._record.stream_id,
            error,
            t,
        )
        self._notify_nack(self._record.node_id, response.type, error)

    def on_stale_nonce(self, resource_type: ResourceType, nonce: str) -> None:
        self._telemetry.stale_nonces.labels(resource_type.short).inc()
        logger.debug(
            "Ignored a %s request with stale nonce %r from node %r (stream %d).",
            resource_type.short,
            nonce,
            self._record.node_id,
            self._record.stream_id,
        )

    def on_unknown_type(self, type_url: str) -> None:
        self._telemetry.unknown_types.inc()
        logger.warning(
            "Node %r asked for %s, which this server does not serve; ignored.",
            self._record.node_id,
            type_url,
        )


_: type[StreamObserver] = _RecordingObserver


class NodeRegistry:
    """Every open stream's record.

    Mutable state: `_streams` (stream id -> record), `revision` and `_ack_waiters`,
    futures woken on every ACK so that callers can wait for a version to be accepted
    without polling.
    """

    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._streams: dict[int, StreamRecord] = {}
        # Grows whenever a stream opens, closes or names its node.
        self.revision = 0
        self._ids = itertools.count(1)
        self._ack_waiters: set[asyncio.Future[None]] = set()
        self._on_node: Callable[[str], None] | None = None
        self._on_nack: Callable[[str, ResourceType, str], None] | None = None

    def subscribe(
        self,
        on_node: Callable[[str], None],
        on_nack: Callable[[str, ResourceType, str], None] | None = None,
    ) -> None:
        """Call `on_node` with the node id of every ADS stream as it identifies itself, and
        `on_nack` with the node id, type and Envoy's error of every NACK (one listener: the
        controller, which gives a new Envoy its own limits at once, and stops sending what
        an Envoy cannot take, such as the spill listener)."""
        self._on_node = on_node
        self._on_nack = on_nack

    def _identified(self, node_id: str) -> None:
        self.revision += 1
        if self._on_node is not None:
            self._on_node(node_id)

    def _rejected(self, node_id: str, resource_type: ResourceType, error: str) -> None:
        if self._on_nack is not None:
            self._on_nack(node_id, resource_type, error)

    def _acked(self) -> None:
        for waiter in self._ack_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._ack_waiters.clear()

    async def wait_for_ack(self, type_name: str, version: str) -> StreamRecord:
        """Wait until some connected node has ACKed `version` of `type_name` (cds, eds, ...)."""
        while True:
            for record in self._streams.values():
                if record.acked.get(type_name) == version:
                    return record
            waiter = asyncio.get_running_loop().create_future()
            self._ack_waiters.add(waiter)
            await waiter

    def open(self, *, protocol: str, peer: str) -> tuple[StreamRecord, StreamObserver]:
        record = StreamRecord(
            stream_id=next(self._ids), protocol=protocol, peer=peer, opened_at=time.time()
        )
        self._streams[record.stream_id] = record
        self.revision += 1
        self._telemetry.connected_streams.labels(protocol).inc()
        observer = _RecordingObserver(
            record, self._telemetry, self._acked, self._identified, self._rejected
        )
        return record, observer

    def close(self, record: StreamRecord) -> None:
        if self._streams.pop(record.stream_id, None) is not None:
            self.revision += 1
            self._telemetry.connected_streams.labels(record.protocol).dec()

    def streams(self) -> list[StreamRecord]:
        return list(self._streams.values())

    def to_json(self) -> list[dict[str, object]]:
        return [record.to_json() for record in self._streams.values()]
