"""What the session-key log costs the server, per keyed request, at fleet size.

Every keyed request through a session-affinity pool is one entry of the Envoys' `session_keys`
access log (xds/session_keys.py), sent in batches. This decodes batches of such entries
from their wire bytes, as the ALS stream does, and applies them (`SessionKeyStream.log`):
`--keys` distinct keys spread over `--pools` pools, the keys' header values as long as
`--key-bytes`. It reports the CPU per entry and how many keyed requests a second one core
takes: the figure behind the sizing of the session-key log in docs/operations.md.

    python -m bench.session_key_cost [--pools 10] [--keys 1024] [--entries 64]
        [--batches 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from envoy.service.accesslog.v3 import als_pb2

from xds_server.envoy import names
from xds_server.telemetry import Telemetry
from xds_server.xds.session_keys import SessionKeys, SessionKeyStream

__all__ = ["main", "session_key_cost"]


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


def session_key_cost(
    *, pools: int, keys: int, key_bytes: int = 36, entries: int = 64, batches: int = 300
) -> dict[str, float]:
    """CPU microseconds per logged keyed request, and keyed requests a second per core."""
    rng = random.Random(0)
    wire = [_batch(rng, pools, keys, key_bytes, entries) for _ in range(256)]
    known = frozenset(f"pool-{p:03d}{names.SESSION_CLUSTER_SUFFIX}" for p in range(pools))
    telemetry = Telemetry()
    store = SessionKeys(
        header=names.SESSION_HEADER,
        pool_of=names.session_pool,
        telemetry=telemetry,
        known_clusters=lambda: known,
        clock=time.monotonic,
    )
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.session_key_cost", description=__doc__)
    parser.add_argument("--pools", type=int, default=10)
    parser.add_argument("--keys", type=int, default=1024, help="distinct keys per pool")
    parser.add_argument("--key-bytes", type=int, default=36)
    parser.add_argument("--entries", type=int, default=64, help="entries per batch")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
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
