"""State-of-the-world ADS: the protocol state machine of one stream.

Rules (https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol):

- Each type has its own nonce. A request whose nonce is not the latest one sent for its type
  is stale and ignored. A request with the latest nonce acknowledges that response: an ACK,
  or a NACK when `error_detail` is set. The rejected content is not sent again; the next
  change is.
- At most one unacknowledged response per type; a response is sent only when what the
  client asked for differs from what it was last sent.
- Listener, Cluster and Runtime responses are complete: a resource left out is deleted.
  EDS and RDS responses carry only the resources that changed (or were newly asked for):
  the protocol gives them no deletion signal, and Envoy (and gRPC's client) keep a
  resource a response leaves out. One pod's change is then one assignment on the wire,
  not every pool's.
- Types go out in ADS order. After a CDS response Envoy re-subscribes the updated clusters'
  endpoints and asks for EDS *before* it ACKs CDS; until it asks (or ACKs CDS), EDS is held,
  and the next EDS response carries the ClusterLoadAssignments of every updated cluster
  even if they did not change, or those clusters would stay warming. LDS holds RDS the same
  way.
- Wildcard: a first request with no names (the legacy form) or a request naming "*" asks for
  every resource of the type; naming resources later ends the legacy wildcard.
- A first request carrying the version the server has (a reconnect) is not answered until
  something changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Resource
from xds_server.xds.stream import ProtocolStream, Response, StreamObserver, TypeState

__all__ = ["SotwStream"]

WILDCARD = "*"

# The types whose responses may carry only what changed (module docstring).
_PARTIAL = frozenset({ResourceType.ENDPOINT, ResourceType.ROUTE})


@dataclass
class _SotwTypeState(TypeState):
    names: frozenset[str] = frozenset()
    # Version of each resource the client holds as far as the server knows (what it was
    # sent); None before the first response.
    sent: dict[str, str] | None = None


class SotwStream(ProtocolStream[_SotwTypeState]):
    """The state of one SotW ADS stream. Not thread-safe; one task drives it."""

    def __init__(self, *, stream_id: int, observer: StreamObserver) -> None:
        super().__init__(
            stream_id=stream_id,
            observer=observer,
            states={t: _SotwTypeState() for t in ResourceType},
        )

    def receive(self, request: discovery_pb2.DiscoveryRequest) -> list[Response]:
        """Apply one request and return the responses to send, in order."""
        resource_type = ResourceType.from_url(request.type_url)
        if resource_type is None:
            self._observer.on_unknown_type(request.type_url)
            return []
        state = self._types[resource_type]
        if state.last_nonce is not None and request.response_nonce != state.last_nonce:
            self._observer.on_stale_nonce(resource_type, request.response_nonce)
            return []
        first = not state.subscribed
        self._acknowledge(
            resource_type, request.error_detail if request.HasField("error_detail") else None
        )
        names = frozenset(request.resource_names)
        wildcard = WILDCARD in names or (not names and (first or state.wildcard))
        names -= {WILDCARD}
        if state.sent is not None and not wildcard and names != state.names:
            # A name no longer asked for is forgotten: asked for again, it is sent again.
            state.sent = {n: v for n, v in state.sent.items() if n in names}
        state.wildcard, state.names = wildcard, names
        state.subscribed = True
        state.dirty = True
        state.held = False
        if first and self._snapshot is not None and request.version_info:
            if request.version_info == self._snapshot.versions[resource_type]:
                state.sent = {r.name: r.version for r in self._selected(resource_type, state)}
                state.acked_version = request.version_info
        return self._flush()

    def _selected(self, resource_type: ResourceType, state: _SotwTypeState) -> list[Resource]:
        assert self._snapshot is not None
        held = self._snapshot.resources[resource_type]
        if state.wildcard:
            return list(held.values())
        return [held[name] for name in sorted(state.names) if name in held]

    def _flush(self) -> list[Response]:
        if self._snapshot is None:
            return []
        responses = []
        for resource_type in ResourceType:
            state = self._types[resource_type]
            if not state.dirty:
                continue
            if not state.subscribed or state.outstanding is not None or state.held:
                continue
            state.dirty = False
            selected = self._selected(resource_type, state)
            if resource_type in _PARTIAL and state.sent is not None:
                sent = state.sent
                due = [r for r in selected if sent.get(r.name) != r.version]
                if not due:
                    continue
            else:
                if state.sent == {r.name: r.version for r in selected}:
                    continue
                due = selected
            responses.append(self._respond(resource_type, selected, due))
        return responses

    def _respond(
        self, resource_type: ResourceType, selected: list[Resource], due: list[Resource]
    ) -> Response:
        """A response carrying `due` (of the `selected` resources the client asked for)."""
        assert self._snapshot is not None
        nonce = self._next_nonce()
        version = self._snapshot.versions[resource_type]
        header = discovery_pb2.DiscoveryResponse(
            version_info=version, type_url=resource_type.url, nonce=nonce
        ).SerializeToString()
        response = Response(
            type=resource_type,
            nonce=nonce,
            version=version,
            payload=header + b"".join(r.sotw_fragment for r in due),
            resource_names=tuple(r.name for r in due),
            snapshot_born=self._born,
        )
        state = self._types[resource_type]
        before = state.sent or {}
        state.sent = {r.name: before.get(r.name, "") for r in selected} | {
            r.name: r.version for r in due
        }
        if resource_type is ResourceType.CLUSTER:
            # Envoy re-subscribes an updated cluster's endpoints and needs them re-sent.
            endpoints = self._types[ResourceType.ENDPOINT]
            if endpoints.sent is not None:
                for cluster in due:
                    if before.get(cluster.name) != cluster.version:
                        for name in cluster.references:
                            endpoints.sent.pop(name, None)
                endpoints.dirty = True
        self._sent(resource_type, response)
        return response
