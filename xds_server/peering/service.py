"""The gRPC service a replica's peers watch: its own Envoys' load, streamed.

`xds_server.peering.v1.Peering/Watch` is a server-streaming call on the xDS port (so the
same listener, and later the same mTLS, serve it): the peer sends a hello naming itself,
and this replica answers with its report (reports.py) as JSON, again whenever it changes
(looked at every `interval_s`) and at least every `heartbeat_s`, so a peer can tell a
quiet replica from a dead one. A report is built from the replica's Envoys only: what it
hears from its own peers is never passed on, so nothing is counted twice.

A replica that ends its hello with `KEYS_HELLO` is also sent this replica's own Envoys'
session keys (reports.SessionKeysReport): in the stream's first report and whenever they
change, and left out otherwise (they change every few seconds, the load every 50 ms). A
replica that predates them sends no such suffix, and is sent none.

A server of another cluster ends its hello with `POOLS_HELLO` and is sent this cluster's
per-pool summaries instead (`pools`: reports.PoolReport), on the same stream and mTLS. A
replica that predates them reads the suffix as part of the peer's name and sends its
Envoys' load, which the asker reads as "no summaries" (the link stays up).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from xds_server.peering.reports import ReplicaReport, SessionKeysReport
from xds_server.xds.identity import Authenticator

__all__ = ["KEYS_HELLO", "PEERING_SERVICE", "POOLS_HELLO", "PeeringServer", "WATCH_METHOD"]

logger = logging.getLogger(__name__)

PEERING_SERVICE = "xds_server.peering.v1.Peering"
WATCH_METHOD = f"/{PEERING_SERVICE}/Watch"
# The hello a peer sends names it; anything longer is not a hello.
_MAX_HELLO_BYTES = 1024
# What a hello ends with when the peer asks for per-pool summaries.
POOLS_HELLO = b"\npools"
# What a replica's hello ends with when it takes its peer's session keys.
KEYS_HELLO = b"\nkeys"


def _identity(data: bytes) -> bytes:
    return data


class PeeringServer:
    """Streams `report()` (this replica's own Envoys) to every peer that watches it, or
    `pools()` (the per-pool summaries) to another cluster's server that asks for them."""

    def __init__(
        self,
        *,
        report: Callable[[], ReplicaReport],
        pools: Callable[[], ReplicaReport] | None = None,
        session_keys: Callable[[], SessionKeysReport] | None = None,
        authenticator: Authenticator | None = None,
        interval_s: float = 0.05,
        heartbeat_s: float = 0.25,
    ) -> None:
        self._report = report
        self._pools = pools
        self._session_keys = session_keys
        self._authenticator = authenticator
        self._interval_s = interval_s
        self._heartbeat_s = heartbeat_s

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            PEERING_SERVICE,
            {
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self._watch, request_deserializer=_identity, response_serializer=_identity
                )
            },
        )

    # grpc.aio recognises streaming handlers by inspect.isasyncgenfunction: this must yield.
    async def _watch(
        self, hello: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        if self._authenticator is not None:
            await self._authenticator.admit_peer(context)
        if len(hello) > _MAX_HELLO_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the hello is too long")
        source = self._report
        keys = None
        if hello.endswith(POOLS_HELLO) and self._pools is not None:
            hello, source = hello.removesuffix(POOLS_HELLO), self._pools
        elif hello.endswith(KEYS_HELLO):
            hello, keys = hello.removesuffix(KEYS_HELLO), self._session_keys
        peer = hello.decode("utf-8", errors="replace") or context.peer()
        logger.info("Peer %r watches this replica's load (from %s).", peer, context.peer())
        loop = asyncio.get_running_loop()
        last = b""
        sent_at = float("-inf")
        encoded: tuple[ReplicaReport, bytes] | None = None
        keys_sent: SessionKeysReport | None = None
        try:
            while True:
                # The report is the same object while nothing changed (fleet_load.py):
                # encoded once, not every interval for every peer.
                report = source()
                if encoded is None or encoded[0] is not report:
                    # Fields left at None are left out: a replica that predates them
                    # (`pools`) refuses what it does not know.
                    encoded = (report, report.model_dump_json(exclude_none=True).encode())
                body = plain = encoded[1]
                # The same object while no key was logged (app.py): sent when it is not.
                session_keys = keys() if keys is not None else None
                if session_keys is not None and session_keys is not keys_sent:
                    with_keys = report.model_copy(update={"session_keys": session_keys})
                    body = with_keys.model_dump_json(exclude_none=True).encode()
                    keys_sent = session_keys
                if body is not plain or plain != last or loop.time() - sent_at >= self._heartbeat_s:
                    yield body
                    last, sent_at = plain, loop.time()
                await asyncio.sleep(self._interval_s)
        except asyncio.CancelledError:
            # The server is stopping, or the peer went away: the stream just ends (grpc
            # would log a cancelled handler as an unhandled error).
            return
        finally:
            logger.info("Peer %r stopped watching this replica's load.", peer)
