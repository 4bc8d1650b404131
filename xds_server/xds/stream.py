"""What the protocol state machines (sotw.py, delta.py) share: responses and the observer seam.

The state machines are synchronous and do no I/O: they take a request or a new snapshot and
return the responses to send, in order. The gRPC glue in ads.py does the sending. That
keeps every protocol rule testable without sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from envoy.config.core.v3 import base_pb2
from google.rpc import status_pb2

from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

__all__ = ["ProtocolStream", "Response", "StreamObserver", "TypeState"]


@dataclass(frozen=True)
class Response:
    """One encoded DiscoveryResponse or DeltaDiscoveryResponse and what it carries."""

    type: ResourceType
    nonce: str
    version: str
    payload: bytes
    resource_names: tuple[str, ...]
    removed: tuple[str, ...] = ()
    # Monotonic time the snapshot behind this response was set: push latency starts here.
    snapshot_born: float = 0.0


class StreamObserver(Protocol):
    """Told what happens on one stream; implemented by the node registry (nodes.py)."""

    def on_node(self, node: base_pb2.Node) -> None: ...

    def on_sent(self, response: Response) -> None: ...

    def on_ack(self, response: Response) -> None: ...

    def on_nack(self, response: Response, error: str) -> None: ...

    def on_stale_nonce(self, resource_type: ResourceType, nonce: str) -> None: ...

    def on_unknown_type(self, type_url: str) -> None: ...


@dataclass
class TypeState:
    """Per-type state both protocols keep (mutable; owned by one stream)."""

    subscribed: bool = False
    wildcard: bool = False
    # Latest response sent and not yet acknowledged, if any.
    outstanding: Response | None = None
    last_nonce: str | None = None
    # True while a response of the type this one depends on is unacknowledged.
    held: bool = False
    acked_version: str = ""
    # Something that could make a response of this type due happened since `_flush` last
    # looked at it (a new version of the type, a request, a hold lifted): a stream of
    # hundreds woken for one type's change looks at that type alone.
    dirty: bool = True


StateT = TypeVar("StateT", bound=TypeState)


class ProtocolStream(Generic[StateT]):
    """What the SotW and Delta state machines share: snapshot, nonces, ACK/NACK bookkeeping.

    Mutable state: the snapshot in force, the nonce counter and one StateT per type.
    Subclasses implement `_flush`, which returns the responses the current state makes due.
    """

    def __init__(
        self, *, stream_id: int, observer: StreamObserver, states: dict[ResourceType, StateT]
    ) -> None:
        self.stream_id = stream_id
        self._observer = observer
        self._snapshot: Snapshot | None = None
        self._born = 0.0
        self._types = states
        self._nonces = 0

    def set_snapshot(self, snapshot: Snapshot, *, born: float) -> list[Response]:
        """Adopt `snapshot` (set at monotonic time `born`) and return the responses it makes due."""
        before = self._snapshot
        for resource_type, state in self._types.items():
            if before is None or before.versions[resource_type] != snapshot.versions[resource_type]:
                state.dirty = True
        self._snapshot, self._born = snapshot, born
        return self._flush()

    def acked_versions(self) -> dict[ResourceType, str]:
        return {t: s.acked_version for t, s in self._types.items() if s.acked_version}

    def _flush(self) -> list[Response]:
        raise NotImplementedError

    def _next_nonce(self) -> str:
        self._nonces += 1
        return str(self._nonces)

    def _acknowledge(
        self, resource_type: ResourceType, error_detail: status_pb2.Status | None
    ) -> None:
        """Settle the outstanding response of `resource_type`: an ACK, or a NACK with its error."""
        state = self._types[resource_type]
        response = state.outstanding
        if response is None:
            return
        state.outstanding = None
        if error_detail is not None:
            self._observer.on_nack(response, error_detail.message)
        else:
            state.acked_version = response.version
            self._observer.on_ack(response)
        dependent = resource_type.dependent
        if dependent is not None:
            self._types[dependent].held = False
            self._types[dependent].dirty = True

    def _sent(self, resource_type: ResourceType, response: Response) -> None:
        """Record `response` as sent; it holds the dependent type until Envoy asks or ACKs."""
        state = self._types[resource_type]
        state.outstanding, state.last_nonce = response, response.nonce
        dependent = resource_type.dependent
        if dependent is not None:
            self._types[dependent].held = True
        self._observer.on_sent(response)
