"""Session keys as Envoy's Maglev sees them: their hashes, how often, and where they went.

A session cluster (`<pool>/session`, `<pool>/session/<band>`) sends each request to the
slot `xxHash64(session header, seed 0) % table_size` of its Maglev table. To place keys by
predicting that table, the policy needs the hashes of the keys each pool serves and their
rates. The listener's router (envoy/listeners.py) logs, in batches over gRPC (ALS, log
`session_keys`), the upstream stream of each request that carries the session header,
once, when the stream to the pod is established (UpstreamPoolReady), with the header's
value. `SessionKeys` hashes the value at once: the key itself is never kept nor logged.

Per pool it keeps, for each key hash, a count of its requests that halves every
`half_life_s`, and the endpoint ("address:port") it was last served by; and per endpoint,
the share of the keyed requests it was sent that returned to it, their key last served
by it too (`return_shares`: two sums that halve every `return_half_life_s`, as the pod's
prefix hits do in metrics/store.py, and start with the pod as its hits do). Only a
return can find the key's prefix in a cache: a key's first request, and its first on
another pod, cannot (policy/affinity.py); a spilled request, whose pod is not known, is
left out of these shares. The first requests of keys on a pod (a new key, or one last
served elsewhere) are also kept, with when they were logged (`first_requests`): each is a
prefill of the whole prompt, and the policy sends the next new keys to pods with fewer of
them (policy/buckets.py). A request that went to a spilling pod's internal listener counts
towards its key's requests, but does not change where the key was
last seen: Envoy 1.40 logs its upstream address as the listener (`envoy_internal_address`,
its `endpoint_id` the spilling pod's ring key, which is its name when it has one), not as
the pod that served it. Bounds, so that an Envoy (or a client inventing keys) cannot make
the server hold much: at most `max_keys` keys per pool (over it, the smallest counts go,
down to 7/8 of it, so that a flood of new keys costs one sort per `max_keys / 8` keys; the
key just seen always stays), a key unseen for `forget_after_s` is dropped, and a header
value over `max_key_bytes` is not taken; at most `max_keys` endpoints' returns per pool
(over it, the longest unseen go), forgotten as keys are. Only clusters this server pushed
count.

`SessionKeyStream` is one ALS stream's state (no I/O); access_logs.AccessLogServer moves
the messages and sends each stream here or to the long prompts by its log name.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass
from types import MappingProxyType

import xxhash
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from xds_server.clock import Clock
from xds_server.telemetry import Telemetry

__all__ = ["KeySeen", "SessionKeyStream", "SessionKeys", "key_hash"]

logger = logging.getLogger(__name__)


def key_hash(value: str) -> int:
    """The hash Envoy's hash policy takes of a header value: xxHash64 of its bytes, seed 0."""
    return xxhash.xxh64_intdigest(value.encode(), seed=0)


@dataclass(frozen=True)
class KeySeen:
    """One key of a pool: its requests' count, decayed to the snapshot's time, and the
    endpoint ("address:port") it was last served by (None: only seen spilled)."""

    count: float
    endpoint: str | None


@dataclass
class _Key:
    count: float  # as of `at`
    at: float
    endpoint: str | None


@dataclass
class _Returns:
    """The keyed requests an endpoint was sent and those of them that returned to it (their
    key last served by it), both decayed to `at`."""

    requests: float
    returned: float
    at: float


class SessionKeys:
    """Key hashes per pool, fed by the session-key log.

    Mutable state: `_pools` (pool -> key hash -> _Key). Runs on the event loop. `revision`
    grows, and the subscriber is called with the pools, when a pool gains a key or a key
    is served by another endpoint (not on every request: counts change all the time);
    `entries` counts the entries taken.
    """

    def __init__(
        self,
        *,
        header: str,
        pool_of: Callable[[str], str | None],
        telemetry: Telemetry,
        known_clusters: Callable[[], Set[str]] | None = None,
        clock: Clock = time.monotonic,
        half_life_s: float = 60.0,
        forget_after_s: float = 600.0,
        max_keys: int = 1_024,
        max_key_bytes: int = 1_024,
        return_half_life_s: float = 10.0,
    ) -> None:
        if (
            min(half_life_s, forget_after_s, return_half_life_s) <= 0
            or min(max_keys, max_key_bytes) < 1
        ):
            raise ValueError("session keys: half-lives, forget time and bounds must be positive")
        self._header = header
        self._pool_of = pool_of
        self._telemetry = telemetry
        self._known_clusters = known_clusters
        self._clock = clock
        self._decay = math.log(2) / half_life_s
        self._forget_after_s = forget_after_s
        self._max_keys = max_keys
        self._max_key_bytes = max_key_bytes
        self._return_decay = math.log(2) / return_half_life_s
        self._pools: dict[str, dict[int, _Key]] = {}
        self._returns: dict[str, dict[str, _Returns]] = {}
        # Per pool, the latest first requests of keys on a pod: (when, endpoint), oldest first.
        self._firsts: dict[str, deque[tuple[float, str]]] = {}
        self._on_change: Callable[[Set[str]], None] | None = None
        self.revision = 0
        self.entries = 0

    def subscribe(self, on_change: Callable[[Set[str]], None]) -> None:
        """Call `on_change` with the pools that gained a key or whose keys moved."""
        self._on_change = on_change

    def logged(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> str | None:
        """Take one log entry. Returns why it was dropped, or None: "no_key" (no session
        header), "oversized_key" (over `max_key_bytes`), "unknown_cluster" (not a cluster
        this server pushed), "not_session" (not a session cluster: a client's header on a
        pool without affinity)."""
        value = entry.request.request_headers.get(self._header, "")
        if not value:
            return "no_key"
        if len(value) > self._max_key_bytes or len(value.encode()) > self._max_key_bytes:
            return "oversized_key"
        common = entry.common_properties
        cluster = common.upstream_cluster
        if self._known_clusters is not None and cluster not in self._known_clusters():
            return "unknown_cluster"
        pool = self._pool_of(cluster)
        if pool is None:
            return "not_session"
        address = common.upstream_remote_address.socket_address
        endpoint = f"{address.address}:{address.port_value}" if address.address else None
        self._seen(pool, key_hash(value), endpoint)
        self.entries += 1
        return None

    def _seen(self, pool: str, hashed: int, endpoint: str | None) -> None:
        now = self._clock()
        keys = self._pools.setdefault(pool, {})
        key = keys.get(hashed)
        if endpoint is not None:
            returned = key is not None and endpoint == key.endpoint
            self._count_return(pool, endpoint, returned, now)
            if not returned:
                firsts = self._firsts.setdefault(pool, deque(maxlen=self._max_keys))
                firsts.append((now, endpoint))
        if key is None:
            keys[hashed] = _Key(1.0, now, endpoint)
            if len(keys) > self._max_keys:
                self._evict(keys, now, hashed)
            self._gauge(pool)
            self._changed(pool)
            return
        key.count = self._decayed(key, now) + 1.0
        key.at = now
        if endpoint is not None and endpoint != key.endpoint:
            key.endpoint = endpoint
            self._changed(pool)

    def _count_return(self, pool: str, endpoint: str, returned: bool, now: float) -> None:
        tallies = self._returns.setdefault(pool, {})
        tally = tallies.get(endpoint)
        if tally is None:
            tallies[endpoint] = _Returns(1.0, float(returned), now)
            if len(tallies) > self._max_keys:
                del tallies[min(tallies, key=lambda e: tallies[e].at)]
            return
        decay = self._return_decay_since(tally, now)
        tally.requests = tally.requests * decay + 1.0
        tally.returned = tally.returned * decay + float(returned)
        tally.at = now

    def first_requests(self, within_s: float) -> Mapping[str, Mapping[str, int]]:
        """Per pool, per endpoint, the keys whose first request on it (the key new there)
        was logged in the last `within_s` seconds; pools and endpoints without any absent.
        Older ones are forgotten (one server asks for one window: its config's); at most
        `max_keys` per pool are kept, the latest."""
        since = self._clock() - within_s
        pools: dict[str, Mapping[str, int]] = {}
        for pool, firsts in list(self._firsts.items()):
            while firsts and firsts[0][0] <= since:
                firsts.popleft()
            if not firsts:
                del self._firsts[pool]
                continue
            counts: dict[str, int] = {}
            for _, endpoint in firsts:
                counts[endpoint] = counts.get(endpoint, 0) + 1
            pools[pool] = MappingProxyType(counts)
        return MappingProxyType(pools)

    def _return_decay_since(self, tally: _Returns, now: float) -> float:
        return math.exp(-self._return_decay * max(0.0, now - tally.at))

    def return_shares(self) -> Mapping[str, Mapping[str, float]]:
        """Per pool, per endpoint, the share of the recent keyed requests (decayed) it was
        sent that returned to it: a read-only copy. Forgotten with the keys."""
        return MappingProxyType(
            {
                pool: MappingProxyType({e: t.returned / t.requests for e, t in tallies.items()})
                for pool, tallies in self._returns.items()
            }
        )

    def _evict(self, keys: dict[int, _Key], now: float, new: int) -> None:
        """Drop the smallest counts (the older of equal ones), never the key just seen."""
        self._forget(keys, now)
        if len(keys) <= self._max_keys:
            return
        key = keys.pop(new)
        keep = self._max_keys - self._max_keys // 8 - 1
        kept = heapq.nlargest(
            keep, keys.items(), key=lambda item: (self._decayed(item[1], now), item[1].at)
        )
        keys.clear()
        keys.update(kept)
        keys[new] = key

    def _forget(self, keys: dict[int, _Key], now: float) -> None:
        since = now - self._forget_after_s
        for hashed in [h for h, key in keys.items() if key.at < since]:
            del keys[hashed]

    def _decayed(self, key: _Key, now: float) -> float:
        return key.count * math.exp(-self._decay * max(0.0, now - key.at))

    def snapshot(self, now: float | None = None) -> Mapping[str, Mapping[int, KeySeen]]:
        """Per pool, each key hash's decayed count as of `now` (the clock's time by default)
        and its last endpoint: a read-only copy. Drops the keys unseen for `forget_after_s`."""
        at = self._clock() if now is None else now
        pools: dict[str, Mapping[int, KeySeen]] = {}
        for pool, keys in list(self._pools.items()):
            self._forget(keys, at)
            self._forget_returns(pool, at)
            self._gauge(pool, at)
            if not keys:
                del self._pools[pool]
                continue
            pools[pool] = MappingProxyType(
                {h: KeySeen(self._decayed(key, at), key.endpoint) for h, key in keys.items()}
            )
        return MappingProxyType(pools)

    def _forget_returns(self, pool: str, now: float) -> None:
        tallies = self._returns.get(pool, {})
        since = now - self._forget_after_s
        for endpoint in [e for e, tally in tallies.items() if tally.at < since]:
            del tallies[endpoint]
        if not tallies and self._returns.pop(pool, None) is not None:
            self._telemetry.session_key_returns.remove(pool)

    def _gauge(self, pool: str, now: float | None = None) -> None:
        self._telemetry.session_keys.labels(pool).set(len(self._pools.get(pool, {})))
        tallies = self._returns.get(pool)
        if now is None or not tallies:
            return
        # Over the pool's endpoints, each one's sums decayed to now: a gone pod fades out.
        decays = [(t, self._return_decay_since(t, now)) for t in tallies.values()]
        requests = sum(t.requests * d for t, d in decays)
        if requests > 0:
            returned = sum(t.returned * d for t, d in decays)
            self._telemetry.session_key_returns.labels(pool).set(returned / requests)

    def _changed(self, pool: str) -> None:
        self.revision += 1
        if self._on_change is not None:
            self._on_change(frozenset({pool}))


class SessionKeyStream:
    """The state of one ALS stream of the session-key log: its entries go to `keys`."""

    def __init__(self, *, stream_id: int, keys: SessionKeys, telemetry: Telemetry) -> None:
        self.stream_id = stream_id
        self._keys = keys
        self._telemetry = telemetry
        self.node_id: str | None = None

    def identify(self, message: als_pb2.StreamAccessLogsMessage) -> None:
        """Take the node from the stream's first message."""
        if self.node_id is None:
            self.node_id = message.identifier.node.id
            logger.info(
                "Node %r opened access log stream %d (log %r).",
                self.node_id, self.stream_id, message.identifier.log_name,
            )  # fmt: skip

    def log(self, entries: Iterable[accesslog_pb2.HTTPAccessLogEntry]) -> None:
        """Apply log entries of the identified stream."""
        for entry in entries:
            dropped = self._keys.logged(entry)
            if dropped is None:
                self._telemetry.session_key_entries.inc()
            else:
                self._telemetry.session_key_dropped_entries.labels(dropped).inc()

    def close(self) -> None:
        if self.node_id is not None:
            logger.info("Access log stream %d of node %r closed.", self.stream_id, self.node_id)
