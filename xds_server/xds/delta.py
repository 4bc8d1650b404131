"""Incremental (Delta) ADS: the protocol state machine of one stream.

Rules (https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol#incremental-xds):

- The server tracks, per type, which version of each resource the client holds: from the
  first request's `initial_resource_versions` (a reconnect), then from what it sent. A
  response carries only resources whose version differs, and names of held resources that
  no longer exist in `removed_resources`.
- Subscription changes (`resource_names_subscribe` / `_unsubscribe`) apply even when the
  request's nonce is stale; only the ACK/NACK meaning of a stale nonce is ignored.
- A first request with nothing subscribed, or a subscription to "*", is a wildcard
  subscription; unsubscribing "*" ends it.
- Order and holds as in SotW: CDS before EDS, LDS before RDS. When a cluster changes, the
  ClusterLoadAssignment it references is sent again (Envoy needs it to finish warming the
  updated cluster) right after the clusters, on the same stream: Envoy already subscribes
  to that name, so it asks for nothing, and it acknowledges the clusters only once they
  have warmed; held until then, the assignment came at Envoy's `initial_fetch_timeout`
  (15 s) instead.
- A NACKed resource is not sent again until it changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Resource
from xds_server.xds.stream import ProtocolStream, Response, StreamObserver, TypeState

__all__ = ["DeltaStream"]

WILDCARD = "*"


@dataclass
class _DeltaTypeState(TypeState):
    names: set[str] = field(default_factory=set)
    # Version of each resource the client holds, as far as the server knows.
    client_has: dict[str, str] = field(default_factory=dict)


class DeltaStream(ProtocolStream[_DeltaTypeState]):
    """The state of one Delta ADS stream. Not thread-safe; one task drives it."""

    def __init__(self, *, stream_id: int, observer: StreamObserver) -> None:
        super().__init__(
            stream_id=stream_id,
            observer=observer,
            states={t: _DeltaTypeState() for t in ResourceType},
        )

    def receive(self, request: discovery_pb2.DeltaDiscoveryRequest) -> list[Response]:
        """Apply one request and return the responses to send, in order."""
        resource_type = ResourceType.from_url(request.type_url)
        if resource_type is None:
            self._observer.on_unknown_type(request.type_url)
            return []
        state = self._types[resource_type]
        subscribe = set(request.resource_names_subscribe)
        unsubscribe = set(request.resource_names_unsubscribe)
        if not state.subscribed:
            state.subscribed = True
            state.wildcard = not subscribe
            state.client_has = dict(request.initial_resource_versions)
        if WILDCARD in subscribe:
            state.wildcard = True
        if WILDCARD in unsubscribe:
            state.wildcard = False
        state.names |= subscribe - {WILDCARD}
        state.names -= unsubscribe
        for name in unsubscribe:
            state.client_has.pop(name, None)
        state.dirty = True

        if request.response_nonce and request.response_nonce != state.last_nonce:
            self._observer.on_stale_nonce(resource_type, request.response_nonce)
        else:
            state.held = False
            if request.response_nonce:
                self._acknowledge(
                    resource_type,
                    request.error_detail if request.HasField("error_detail") else None,
                )
        return self._flush()

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
            held = self._snapshot.resources[resource_type]
            wanted = held.keys() if state.wildcard else state.names & held.keys()
            updates = [
                held[name]
                for name in sorted(wanted)
                if state.client_has.get(name) != held[name].version
            ]
            removed = sorted(name for name in state.client_has if name not in held)
            if updates or removed:
                responses.append(self._respond(resource_type, updates, removed))
        return responses

    def _respond(
        self, resource_type: ResourceType, updates: list[Resource], removed: list[str]
    ) -> Response:
        assert self._snapshot is not None
        nonce = self._next_nonce()
        version = self._snapshot.versions[resource_type]
        header = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=version,
            type_url=resource_type.url,
            nonce=nonce,
            removed_resources=removed,
        ).SerializeToString()
        response = Response(
            type=resource_type,
            nonce=nonce,
            version=version,
            payload=header + b"".join(r.delta_fragment for r in updates),
            resource_names=tuple(r.name for r in updates),
            removed=tuple(removed),
            snapshot_born=self._born,
        )
        state = self._types[resource_type]
        for resource in updates:
            state.client_has[resource.name] = resource.version
        for name in removed:
            del state.client_has[name]
        resend = False
        if resource_type is ResourceType.CLUSTER:
            # An updated cluster needs its endpoints again, which Envoy will not ask for.
            endpoints = self._types[ResourceType.ENDPOINT]
            for resource in updates:
                for name in resource.references:
                    resend = endpoints.client_has.pop(name, None) is not None or resend
            endpoints.dirty = True
        self._sent(resource_type, response)
        if resend:
            self._types[ResourceType.ENDPOINT].held = False
        return response
