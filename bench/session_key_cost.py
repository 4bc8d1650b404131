"""What the session-key log costs the server, per keyed request, at fleet size.

Every keyed request through a session-affinity pool is one entry of the Envoys' `session_keys`
access log (xds/session_keys.py), sent in batches. This decodes batches of such entries
from their wire bytes, as the ALS stream does, and applies them (`SessionKeyStream.log`):
`--keys` distinct keys spread over `--pools` pools, the keys' header values as long as
`--key-bytes`. It reports the CPU per entry and how many keyed requests a second one core
takes: the figure behind the sizing of the session-key log in docs/operations.md.

With `--over-grpc`, the batches go through the server's own ALS service on a gRPC server
on loopback instead, sent by another process as fast as it can on `--streams` streams
(one per Envoy), and the server process's CPU (its gRPC threads too) is counted per
message and per entry: small batches (`--entries 4`) show what each message costs beyond
its entries, which is what a shorter flush interval (`balancing.key_log_flush_s`) adds.

    python -m bench.session_key_cost [--pools 10] [--keys 1024] [--entries 64]
        [--batches 300] [--over-grpc [--streams 8]] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import time
from collections.abc import Iterator

import grpc
from envoy.service.accesslog.v3 import als_pb2

from xds_server.envoy import listeners, names
from xds_server.telemetry import Telemetry
from xds_server.xds.access_logs import ALS_SERVICE, AccessLogServer, PrefillingPrompts
from xds_server.xds.session_keys import SessionKeys, SessionKeyStream

__all__ = ["main", "session_key_cost", "session_key_cost_over_grpc"]


def _batch(rng: random.Random, pools: int, keys: int, key_bytes: int, entries: int) -> bytes:
    """One ALS message of `entries` keyed requests, serialized as an Envoy sends it."""
    message = als_pb2.StreamAccessLogsMessage()
    for _ in range(entries):
        pool = rng.randrange(pools)
        key = rng.randrange(keys)
        entry = message.http_logs.log_entry.add()
        entry.common_properties.upstream_cluster = f"pool-{pool:03d}{names.SESSION_CLUSTER_SUFFIX}"
        address = entry.common_properties.upstream_remote_address.socket_address
        address.address = f"10.0.{pool % 250}.{key % 250}"
        address.port_value = 8000
        value = f"session-{pool}-{key}-".ljust(key_bytes, "x")
        entry.request.request_headers[names.SESSION_HEADER] = value
    wire: bytes = message.SerializeToString()
    return wire


def _store(pools: int, telemetry: Telemetry) -> SessionKeys:
    known = frozenset(f"pool-{p:03d}{names.SESSION_CLUSTER_SUFFIX}" for p in range(pools))
    return SessionKeys(
        header=names.SESSION_HEADER,
        pool_of=names.session_pool,
        telemetry=telemetry,
        known_clusters=lambda: known,
        clock=time.monotonic,
    )


def session_key_cost(
    *, pools: int, keys: int, key_bytes: int = 36, entries: int = 64, batches: int = 300
) -> dict[str, float]:
    """CPU microseconds per logged keyed request, and keyed requests a second per core."""
    rng = random.Random(0)
    wire = [_batch(rng, pools, keys, key_bytes, entries) for _ in range(256)]
    telemetry = Telemetry()
    store = _store(pools, telemetry)
    stream = SessionKeyStream(stream_id=1, keys=store, telemetry=telemetry)
    # Warm: every key seen once, so that the timed part is the steady state.
    for data in wire:
        stream.log(als_pb2.StreamAccessLogsMessage.FromString(data).http_logs.log_entry)
    started = time.process_time()
    for i in range(batches):
        message = als_pb2.StreamAccessLogsMessage.FromString(wire[i % len(wire)])
        stream.log(message.http_logs.log_entry)
    per_entry = (time.process_time() - started) / (batches * entries)
    held = sum(len(pool) for pool in store.snapshot().values())
    return {
        "entries_timed": float(batches * entries),
        "keys_held": float(held),
        "cpu_us_per_entry": per_entry * 1e6,
        "entries_per_core_s": 1 / per_entry,
    }


def _send(target: str, wire: list[bytes], batches: int, streams: int) -> None:
    """Another process's Envoys: `streams` ALS streams to `target`, `batches` batches over
    them, the first of each stream naming the session-key log."""
    first = als_pb2.StreamAccessLogsMessage()
    first.identifier.log_name = listeners.SESSION_KEY_LOG
    first.identifier.node.id = "bench"
    opening = first.SerializeToString()

    def stream(count: int) -> Iterator[bytes]:
        for i in range(count):
            yield (opening if i == 0 else b"") + wire[i % len(wire)]

    with grpc.insecure_channel(target) as channel:
        call = channel.stream_unary(
            f"/{ALS_SERVICE}/StreamAccessLogs",
            request_serializer=lambda data: data,
            response_deserializer=als_pb2.StreamAccessLogsResponse.FromString,
        )
        futures = [call.future(stream(batches // streams)) for _ in range(streams)]
        for future in futures:
            future.result()


async def _serve_and_count(
    store: SessionKeys, telemetry: Telemetry, wire: list[bytes], batches: int, streams: int
) -> float:
    """The server's CPU seconds while another process sends the batches."""
    als = AccessLogServer(
        prompts=PrefillingPrompts(stale_s=10.0),
        telemetry=telemetry,
        session_keys=store,
        session_key_log=listeners.SESSION_KEY_LOG,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((als.generic_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        sender = multiprocessing.get_context("spawn").Process(
            target=_send, args=(f"127.0.0.1:{port}", wire, batches, streams)
        )
        started = time.process_time()
        sender.start()
        await asyncio.get_running_loop().run_in_executor(None, sender.join)
        used = time.process_time() - started
    finally:
        await server.stop(None)
    if sender.exitcode != 0:
        raise RuntimeError(f"the sending process failed (exit code {sender.exitcode})")
    return used


def session_key_cost_over_grpc(
    *,
    pools: int,
    keys: int,
    key_bytes: int = 36,
    entries: int = 64,
    batches: int = 3000,
    streams: int = 8,
) -> dict[str, float]:
    """CPU microseconds per message and per entry through the server's ALS service, and
    messages a second per core."""
    rng = random.Random(0)
    wire = [_batch(rng, pools, keys, key_bytes, entries) for _ in range(256)]
    telemetry = Telemetry()
    store = _store(pools, telemetry)
    sent = batches // streams * streams
    used = asyncio.run(_serve_and_count(store, telemetry, wire, sent, streams))
    logged = sum(len(pool) for pool in store.snapshot().values())
    return {
        "messages": float(sent),
        "entries": float(sent * entries),
        "keys_held": float(logged),
        "cpu_us_per_message": used / sent * 1e6,
        "cpu_us_per_entry": used / (sent * entries) * 1e6,
        "messages_per_core_s": sent / used,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.session_key_cost", description=__doc__)
    parser.add_argument("--pools", type=int, default=10)
    parser.add_argument("--keys", type=int, default=1024, help="distinct keys per pool")
    parser.add_argument("--key-bytes", type=int, default=36)
    parser.add_argument("--entries", type=int, default=64, help="entries per batch")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--over-grpc", action="store_true")
    parser.add_argument("--streams", type=int, default=8, help="ALS streams, with --over-grpc")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.over_grpc:
        over = session_key_cost_over_grpc(
            pools=args.pools,
            keys=args.keys,
            key_bytes=args.key_bytes,
            entries=args.entries,
            batches=args.batches,
            streams=args.streams,
        )
        print(
            json.dumps(over)
            if args.json
            else f"{over['cpu_us_per_message']:.0f} us of CPU per message of {args.entries}"
            f" entries ({over['cpu_us_per_entry']:.1f} us an entry): one core takes"
            f" {over['messages_per_core_s']:,.0f} messages a second"
        )
        return 0
    result = session_key_cost(
        pools=args.pools,
        keys=args.keys,
        key_bytes=args.key_bytes,
        entries=args.entries,
        batches=args.batches,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['cpu_us_per_entry']:.1f} us of CPU per keyed request logged"
            f" ({result['keys_held']:.0f} keys held): one core takes"
            f" {result['entries_per_core_s']:,.0f} keyed requests a second"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
