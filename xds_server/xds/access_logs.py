"""Long prompts while they prefill: Envoy's upstream access log over gRPC (ALS).

The load reports (load_reports.py) say which pod has a long prompt in flight, but only once
per report interval, and only "in flight": a short request sent to that pod waits behind
the long prefill, not behind its decode. So the listener's router (envoy/listeners.py) also
logs the upstream streams of long prompts, unbatched, to this server's
`AccessLogService.StreamAccessLogs`
(https://www.envoyproxy.io/docs/envoy/latest/api-v3/service/accesslog/v3/als.proto): when
the stream to the pod is established (`access_log_type` UpstreamPoolReady,
`flush_upstream_log_on_upstream_stream`), periodically while it lasts (UpstreamPeriodic,
listeners.LONG_PROMPT_LOG_INTERVAL_S) and when it ends (UpstreamEnd). A model server sends
its response headers at once and its first body bytes with the first token (vLLM's and
the simulator's SSE streams), so a long prompt is prefilling from its start until its
upstream stream has received body bytes. In an upstream log entry those are
`request.request_body_bytes`: the entry is built from the upstream request's stream info,
whose bytes *received* are the response's (checked on Envoy 1.40: 0 until the first token,
then growing; its `response_body_bytes` is the prompt sent). The policy learns within
milliseconds where a long prompt went, and within one log interval that its prefill is
over.

A log entry is not a callout: Envoy writes it on its own time, and no request waits for it.

`PrefillingPrompts` keeps, per cluster and endpoint, the upstream streams still prefilling.
One not heard of for `stale_s` is dropped (its end was lost with its stream), so a pod
cannot stay marked for good. Only clusters the server pushed are kept, and at most
`max_per_log` streams per Envoy, so what an Envoy can make the server hold is bounded.
`AccessLogStream` is the protocol state machine of one stream (no I/O), as in
load_stats.py; `AccessLogServer` only moves messages, and sends the streams of the
session-key log (its own log name) to session_keys.py instead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Set
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from xds_server.clock import Clock
from xds_server.telemetry import Telemetry
from xds_server.xds.identity import Authenticator
from xds_server.xds.session_keys import SessionKeys, SessionKeyStream

__all__ = [
    "ALS_SERVICE",
    "AccessLogServer",
    "AccessLogStream",
    "PrefillingPrompts",
]

logger = logging.getLogger(__name__)

ALS_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
# Log entries applied between two turns of the event loop.
_ENTRIES_PER_SLICE = 100


@dataclass(frozen=True)
class _Stream:
    """One upstream stream: the ALS stream it was logged on, and what tells it apart there.
    Envoy 1.40 leaves `stream_id` empty in upstream logs, so that is the stream's start time
    (ns), its upstream connection and its client's address: two requests on one
    connection do not start in the same nanosecond."""

    log_stream: int
    start_ns: int
    upstream_local: str
    downstream_remote: str


class PrefillingPrompts:
    """Long prompts' upstream streams still prefilling, per (cluster, endpoint "address:port").

    Mutable state: `_open` (cluster -> endpoint -> stream -> monotonic time last heard of)
    and `_nodes` (ALS stream -> node id). Runs on the event loop; the ALS streams call
    `open`, `logged` and `close`. The subscriber is called with the clusters whose prefilling
    streams changed.
    """

    def __init__(
        self,
        *,
        stale_s: float,
        clock: Clock = time.monotonic,
        known_clusters: Callable[[], Set[str]] | None = None,
        max_per_log: int = 1_000,
    ) -> None:
        self._stale_s = stale_s
        self._clock = clock
        self._known_clusters = known_clusters
        self._max_per_log = max_per_log
        # Prefilling streams per ALS stream, to bound what one Envoy can make us hold.
        self._per_log: dict[int, int] = {}
        self._on_change: Callable[[Set[str]], None] | None = None
        self._open: dict[str, dict[str, dict[_Stream, float]]] = {}
        self._nodes: dict[int, str] = {}

    def subscribe(self, on_change: Callable[[Set[str]], None]) -> None:
        """Call `on_change` with the clusters whose figures changed, from now on (one
        listener: the controller, which is built after this and reads it)."""
        self._on_change = on_change

    def idle_nodes(self) -> frozenset[str] | None:
        """The Envoys logging, when none of them has a long prompt prefilling; None while
        some has. What the prompts add to the fleet's load is then a function of this
        alone (no stream to expire with time): a reader may keep what it made of it."""
        if any(streams for endpoints in self._open.values() for streams in endpoints.values()):
            return None
        return frozenset(self._nodes.values())

    def open(self, log_stream: int, node_id: str) -> None:
        """ALS stream `log_stream` of Envoy `node_id` started logging."""
        self._nodes[log_stream] = node_id

    def logged(self, log_stream: int, entry: accesslog_pb2.HTTPAccessLogEntry) -> str | None:
        """Apply one upstream log entry: a stream starts or goes on prefilling, or its
        prefill is over (body bytes received), or it ended. Returns why the entry was
        dropped ("unknown_cluster": not a cluster this server pushed; "over_bound": its
        Envoy already has `max_per_log` streams prefilling), or None."""
        common = entry.common_properties
        address = common.upstream_remote_address.socket_address
        if not (common.upstream_cluster and address.address):
            return None
        cluster = common.upstream_cluster
        if self._known_clusters is not None and cluster not in self._known_clusters():
            return "unknown_cluster"
        endpoint = f"{address.address}:{address.port_value}"
        local = common.upstream_local_address.socket_address
        client = common.downstream_remote_address.socket_address
        stream = _Stream(
            log_stream,
            common.start_time.ToNanoseconds(),
            f"{local.address}:{local.port_value}",
            f"{client.address}:{client.port_value}",
        )
        streams = self._open.setdefault(cluster, {}).setdefault(endpoint, {})
        answering = entry.request.request_body_bytes > 0
        if common.access_log_type == accesslog_pb2.UpstreamEnd or answering:
            known = streams.pop(stream, None) is not None
            if known:
                self._per_log[log_stream] -= 1
        else:
            known = stream in streams
            if not known and self._per_log.get(log_stream, 0) >= self._max_per_log:
                self._prune(cluster)
                return "over_bound"
            if not known:
                self._per_log[log_stream] = self._per_log.get(log_stream, 0) + 1
            streams[stream] = self._clock()
        self._prune(cluster)
        if known != (stream in streams):
            self._changed({cluster})
        return None

    def close(self, log_stream: int) -> None:
        """Drop what ALS stream `log_stream` logged: its Envoy went away."""
        self._nodes.pop(log_stream, None)
        self._per_log.pop(log_stream, None)
        changed = set()
        for cluster, endpoints in self._open.items():
            for streams in endpoints.values():
                for stream in [s for s in streams if s.log_stream == log_stream]:
                    del streams[stream]
                    changed.add(cluster)
        for cluster in changed:
            self._prune(cluster)
        self._changed(changed)

    def nodes(self) -> set[str]:
        """The Envoys (node ids) logging now: their long prompts are known from here."""
        return set(self._nodes.values())

    def prefilling(self, cluster: str) -> dict[str, int]:
        """Streams of `cluster` still prefilling, per endpoint (those not heard of for
        `stale_s` are dropped)."""
        self._drop_stale(cluster)
        return {endpoint: len(streams) for endpoint, streams in self._open.get(cluster, {}).items()}

    def prefilling_by_node(self, cluster: str) -> dict[str, dict[str, int]]:
        """Streams of `cluster` still prefilling, per Envoy (node id) and endpoint."""
        self._drop_stale(cluster)
        counts: dict[str, dict[str, int]] = {}
        for endpoint, streams in self._open.get(cluster, {}).items():
            for stream in streams:
                node = counts.setdefault(self._nodes.get(stream.log_stream, ""), {})
                node[endpoint] = node.get(endpoint, 0) + 1
        return counts

    def _drop_stale(self, cluster: str) -> None:
        since = self._clock() - self._stale_s
        for streams in self._open.get(cluster, {}).values():
            for stream in [s for s, at in streams.items() if at < since]:
                del streams[stream]
                if stream.log_stream in self._per_log:
                    self._per_log[stream.log_stream] -= 1
        self._prune(cluster)

    def _prune(self, cluster: str) -> None:
        """Forget the endpoints (and the cluster) left without open streams: pods come and
        go, and their keys must not pile up."""
        endpoints = self._open.get(cluster, {})
        for endpoint in [e for e, streams in endpoints.items() if not streams]:
            del endpoints[endpoint]
        if not endpoints:
            self._open.pop(cluster, None)

    def _changed(self, clusters: Set[str]) -> None:
        if clusters and self._on_change is not None:
            self._on_change(frozenset(clusters))


class AccessLogStream:
    """The state of one ALS stream: the first message names the Envoy (and the log), each
    message carries HTTP log entries, which go to `prompts`."""

    def __init__(self, *, stream_id: int, prompts: PrefillingPrompts, telemetry: Telemetry) -> None:
        self.stream_id = stream_id
        self._prompts = prompts
        self._telemetry = telemetry
        self.node_id: str | None = None

    def receive(self, message: als_pb2.StreamAccessLogsMessage) -> None:
        """Apply one message."""
        self.identify(message)
        self.log(message.http_logs.log_entry)

    def identify(self, message: als_pb2.StreamAccessLogsMessage) -> None:
        """Take the node from the stream's first message."""
        if self.node_id is None:
            self.node_id = message.identifier.node.id
            self._prompts.open(self.stream_id, self.node_id)
            logger.info(
                "Node %r opened access log stream %d (log %r).",
                self.node_id, self.stream_id, message.identifier.log_name,
            )  # fmt: skip

    def log(self, entries: Iterable[accesslog_pb2.HTTPAccessLogEntry]) -> None:
        """Apply log entries of the identified stream."""
        for entry in entries:
            dropped = self._prompts.logged(self.stream_id, entry)
            if dropped is not None:
                self._telemetry.als_dropped_entries.labels(dropped).inc()
                continue
            kind = accesslog_pb2.AccessLogType.Name(entry.common_properties.access_log_type)
            self._telemetry.als_entries.labels(kind).inc()

    def close(self) -> None:
        self._prompts.close(self.stream_id)
        if self.node_id is not None:
            logger.info("Access log stream %d of node %r closed.", self.stream_id, self.node_id)


class AccessLogServer:
    """Serves ALS: each stream goes, by its first message's log name, to the session keys
    (`session_key_log`) or to the long prompts (any other)."""

    def __init__(
        self,
        *,
        prompts: PrefillingPrompts,
        telemetry: Telemetry,
        authenticator: Authenticator | None = None,
        session_keys: SessionKeys | None = None,
        session_key_log: str | None = None,
    ) -> None:
        self._prompts = prompts
        self._telemetry = telemetry
        self._authenticator = authenticator
        self._session_keys = session_keys
        self._session_key_log = session_key_log
        self._ids = itertools.count(1)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            ALS_SERVICE,
            {
                "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                    self._stream,
                    request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
                    response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString,
                )
            },
        )

    def _open(self, message: als_pb2.StreamAccessLogsMessage) -> AccessLogStream | SessionKeyStream:
        stream_id = next(self._ids)
        log_name = message.identifier.log_name
        if self._session_keys is not None and log_name == self._session_key_log:
            return SessionKeyStream(
                stream_id=stream_id, keys=self._session_keys, telemetry=self._telemetry
            )
        return AccessLogStream(
            stream_id=stream_id, prompts=self._prompts, telemetry=self._telemetry
        )

    async def _stream(
        self,
        messages: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        stream: AccessLogStream | SessionKeyStream | None = None
        self._telemetry.als_streams.inc()
        try:
            async for message in messages:
                if stream is None:
                    if self._authenticator is not None:
                        node_id = message.identifier.node.id
                        await self._authenticator.admit_envoy(
                            context, node_id=node_id, service="als"
                        )
                    stream = self._open(message)
                stream.identify(message)
                # A slice at a time, so that a huge message cannot hold the event loop.
                entries = message.http_logs.log_entry
                for start in range(0, len(entries), _ENTRIES_PER_SLICE):
                    stream.log(entries[start : start + _ENTRIES_PER_SLICE])
                    await asyncio.sleep(0)
        finally:
            if stream is not None:
                stream.close()
            self._telemetry.als_streams.dec()
        return als_pb2.StreamAccessLogsResponse()
