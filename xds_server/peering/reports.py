"""What one server replica tells the others of its Envoys' load (pure: no I/O).

A replica's report lists every Envoy connected to it: per cluster the flow-control and
long-prompt lanes need (the routing config names them), the latest load report's
requests in flight (in total and per endpoint) and rates, and, for an Envoy that logs its
long prompts (ALS), those still prefilling per endpoint. An Envoy connected over ADS whose
load reports have not arrived yet is listed too, without them.

A server in another cluster (a remote of some pool: config.RemoteConfig.peer) asks for
per-pool summaries instead (`pools`, service.py): each pool's healthy pods, saturation,
capacity and whether it is failing over itself. A replica that predates them sends none
(`pools` None), and is used blind (policy/failover.py).

A replica that asks for them (service.py's KEYS_HELLO) is also sent the session keys its
peer's own Envoys logged (`session_keys`: per pool, each key's hash and decayed count), in
the first report of a stream and whenever they change, so that replicas place a pool's
keys from the same keys (policy/homes.py), with its key homes: the replicas follow the one
whose name sorts first (peering/links.py). Reports without them leave the peer's last ones
standing.

Reports cross the network as JSON and are distrusted like any input: sizes and counts are
bounded, numbers must be finite and non-negative, and unknown fields are refused.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ClusterReport",
    "EnvoyReport",
    "MAX_REPORTED_SESSION_KEYS",
    "MAX_REPORT_BYTES",
    "MAX_SESSION_KEYS",
    "PoolReport",
    "ReplicaReport",
    "SessionKeysReport",
]

# A report larger than this is refused (thousands of Envoys and clusters fit well within).
MAX_REPORT_BYTES = 8 * 1024 * 1024

_Name = Annotated[str, Field(min_length=1, max_length=512)]
_Count = Annotated[int, Field(ge=0, le=10_000_000)]
_Rate = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
# Session keys per pool a report may carry: xds/session_keys.py keeps at most as many.
MAX_SESSION_KEYS = 1024
# Session keys a report carries in all (about 30 bytes each in JSON: 2 MB, well within
# MAX_REPORT_BYTES); a replica with more pools sends each pool's busiest share of them.
MAX_REPORTED_SESSION_KEYS = 65_536
_KeyHash = Annotated[int, Field(ge=0, lt=2**64)]
# A ring-weight factor (Tuning.home_max_factor is at most 100).
_Factor = Annotated[float, Field(ge=0.01, le=100, allow_inf_nan=False)]
# A key bucket (`balancing.key_buckets` is at most 1,024).
MAX_KEY_BUCKETS = 1024
_Bucket = Annotated[int, Field(ge=0, lt=MAX_KEY_BUCKETS)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClusterReport(_Strict):
    """One cluster in one Envoy's latest load report."""

    in_progress: _Count = 0
    # Requests in flight per endpoint ("address:port"), for the long-prompt lanes.
    by_endpoint: Annotated[dict[_Name, _Count], Field(max_length=10_000)] = {}
    issued_per_s: _Rate = 0.0
    successful_per_s: _Rate = 0.0
    # Requests refused by the cluster's circuit breaker (429), per second.
    dropped_per_s: _Rate = 0.0


class EnvoyReport(_Strict):
    """One Envoy's load, as the replica it is connected to knows it."""

    node_id: _Name
    # Its load reports (LRS) arrive at this replica; False for an Envoy connected over ADS
    # only so far (a reconnect: its load reports follow within seconds).
    reports_load: bool = False
    # Per cluster name (those of the routing config's lanes) from its latest load report.
    clusters: Annotated[dict[_Name, ClusterReport], Field(max_length=10_000)] = {}
    # Long prompts still prefilling, per cluster and endpoint, for an Envoy that logs them
    # (ALS); None for one that does not (its lanes' requests in flight count instead).
    prefilling: Annotated[
        dict[_Name, Annotated[dict[_Name, _Count], Field(max_length=10_000)]] | None,
        Field(max_length=10_000),
    ] = None


class PoolReport(_Strict):
    """One pool as its cluster's server sees it, for the servers of other clusters."""

    healthy: _Count
    endpoints: _Count
    # Requests running and waiting over the healthy pods' batch limit (None: none healthy).
    saturation: Annotated[float | None, Field(ge=0, le=1e6, allow_inf_nan=False)] = None
    capacity: _Count = 0
    # The pool wants to send some of its own traffic to remotes now (local share < 1).
    failing_over: bool = False


class SessionKeysReport(_Strict):
    """The session keys a replica's own Envoys logged: per pool, (key hash, decayed
    request count) pairs; and its key homes: per session pool, each endpoint's ring-weight
    factor (policy/homes.py), or its key buckets (policy/buckets.py), which the replicas
    that follow it take as theirs."""

    pools: Annotated[
        dict[
            _Name, Annotated[tuple[tuple[_KeyHash, _Rate], ...], Field(max_length=MAX_SESSION_KEYS)]
        ],
        Field(max_length=10_000),
    ] = {}
    factors: Annotated[
        dict[_Name, Annotated[dict[_Name, _Factor], Field(max_length=10_000)]],
        Field(max_length=10_000),
    ] = {}
    # Per pool, the pod (endpoint id) each reported key was last served by, where its own
    # Envoys said: a replica that places key buckets pins a bucket there (buckets.py).
    served_by: Annotated[
        dict[_Name, Annotated[dict[_KeyHash, _Name], Field(max_length=MAX_SESSION_KEYS)]],
        Field(max_length=10_000),
    ] = {}
    # Its key buckets (policy/buckets.py), per pool that keeps them: each endpoint's
    # pinned buckets, and the endpoints new keys go to; its followers take both.
    buckets: Annotated[
        dict[
            _Name,
            Annotated[
                dict[_Name, Annotated[tuple[_Bucket, ...], Field(max_length=MAX_KEY_BUCKETS)]],
                Field(max_length=10_000),
            ],
        ],
        Field(max_length=10_000),
    ] = {}
    spares: Annotated[
        dict[_Name, Annotated[tuple[_Name, ...], Field(max_length=10_000)]],
        Field(max_length=10_000),
    ] = {}


class ReplicaReport(_Strict):
    """Everything one replica knows of its own Envoys, or (asked by another cluster's
    server) of its pools."""

    replica: _Name
    envoys: Annotated[tuple[EnvoyReport, ...], Field(max_length=10_000)] = ()
    pools: Annotated[dict[_Name, PoolReport] | None, Field(max_length=10_000)] = None
    # Its own Envoys' session keys, when they changed since this stream last sent them.
    session_keys: SessionKeysReport | None = None
