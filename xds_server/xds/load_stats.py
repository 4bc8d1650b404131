"""The Load Reporting Service (LRS): `LoadReportingService.StreamLoadStats`.

Envoy opens one LRS stream to the server named by the bootstrap's
`cluster_manager.load_stats_config` (this server, on the ADS port) and sends a first
LoadStatsRequest carrying its node and no stats. The server answers once, with
`send_all_clusters`, `report_endpoint_granularity` (requests in flight per endpoint, not
only per locality) and the interval it wants; Envoy then reports every cluster it knows
each interval, for as long as the stream lives
(https://www.envoyproxy.io/docs/envoy/latest/api-v3/service/load_stats/v3/lrs.proto).
Envoy applies the interval as a timer in milliseconds, with no minimum of its own.

`LoadStatsStream` is the protocol state machine of one stream (synchronous, no I/O, as the
ADS streams in sotw.py and delta.py); `LoadStatsServer` only moves messages.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.load_stats.v3 import lrs_pb2
from google.protobuf import duration_pb2

from xds_server.xds.identity import Authenticator
from xds_server.xds.load_reports import LoadReports, NodeLoad

__all__ = ["LRS_SERVICE", "LoadStatsServer", "LoadStatsStream"]

logger = logging.getLogger(__name__)

LRS_SERVICE = "envoy.service.load_stats.v3.LoadReportingService"


def _duration(seconds: float) -> duration_pb2.Duration:
    micros = round(seconds * 1_000_000)
    return duration_pb2.Duration(seconds=micros // 1_000_000, nanos=(micros % 1_000_000) * 1000)


class LoadStatsStream:
    """The state of one LRS stream: unidentified until its first request, then reporting.

    Mutable state: the node entry in the store (None until the first request).
    """

    def __init__(self, *, stream_id: int, reports: LoadReports, interval_s: float) -> None:
        self.stream_id = stream_id
        self._reports = reports
        self._interval_s = interval_s
        self.node: NodeLoad | None = None

    def receive(self, request: lrs_pb2.LoadStatsRequest) -> list[lrs_pb2.LoadStatsResponse]:
        """Apply one request; returns the responses to send (one, to the first request)."""
        if self.node is None:
            self.node = self._reports.open(self.stream_id, request.node)
            logger.info(
                "Node %r (cluster %r) opened LRS stream %d; reports every %.3f s.",
                request.node.id, request.node.cluster, self.stream_id, self._interval_s,
            )  # fmt: skip
            if request.cluster_stats:
                self._reports.report(self.stream_id, request.cluster_stats)
            return [
                lrs_pb2.LoadStatsResponse(
                    send_all_clusters=True,
                    load_reporting_interval=_duration(self._interval_s),
                    report_endpoint_granularity=True,
                )
            ]
        self._reports.report(self.stream_id, request.cluster_stats)
        logger.debug(
            "Load report from node %r on LRS stream %d: %d clusters.",
            self.node.node_id, self.stream_id, len(request.cluster_stats),
        )  # fmt: skip
        return []

    def close(self) -> None:
        self._reports.close(self.stream_id)
        if self.node is not None:
            logger.info("LRS stream %d of node %r closed.", self.stream_id, self.node.node_id)


class LoadStatsServer:
    """Serves LRS into a LoadReports store, asking for a report every `interval_s` seconds."""

    def __init__(
        self,
        *,
        reports: LoadReports,
        interval_s: float,
        authenticator: Authenticator | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"the load report interval must be positive, not {interval_s}")
        self._reports = reports
        self._interval_s = interval_s
        self._authenticator = authenticator
        self._ids = itertools.count(1)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            LRS_SERVICE,
            {
                "StreamLoadStats": grpc.stream_stream_rpc_method_handler(
                    self._stream,
                    request_deserializer=lrs_pb2.LoadStatsRequest.FromString,
                    response_serializer=lrs_pb2.LoadStatsResponse.SerializeToString,
                )
            },
        )

    # grpc.aio recognises streaming handlers by inspect.isasyncgenfunction: this must yield.
    async def _stream(
        self,
        requests: AsyncIterator[lrs_pb2.LoadStatsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[lrs_pb2.LoadStatsResponse]:
        stream = LoadStatsStream(
            stream_id=next(self._ids), reports=self._reports, interval_s=self._interval_s
        )
        try:
            async for request in requests:
                if stream.node is None and self._authenticator is not None:
                    node_id = request.node.id
                    await self._authenticator.admit_envoy(context, node_id=node_id, service="lrs")
                for response in stream.receive(request):
                    yield response
        finally:
            stream.close()
