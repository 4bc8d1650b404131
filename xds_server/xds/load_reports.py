"""What the connected Envoys report over LRS: per cluster, requests in flight and rates.

Envoy's load reporter (Load Reporting Service,
https://www.envoyproxy.io/docs/envoy/latest/api-v3/service/load_stats/v3/lrs.proto) sends,
every `load_reporting_interval`, per cluster and locality: `total_requests_in_progress` (a
gauge: requests on upstream connections right now) and `total_successful_requests`,
`total_error_requests`, `total_issued_requests`, which are *latched* counters: each report
carries the requests finished (or issued) since the previous one, over the cluster's
`load_report_interval`. So a rate is the reported total over that interval; nothing needs to
be differenced here. A locality is left out of a report when its window issued no request
and it has none in flight (Envoy 1.40; older Envoys: nothing finished and nothing in
flight), so a cluster's figures are the sum over the localities present (or 0). That rule
also drops the completions of a window that issued nothing: rates undercount when long
requests finish in an otherwise idle window; `in_progress` is always exact.

The server asks for endpoint granularity too (`report_endpoint_granularity`, Envoy 1.40):
each locality then lists `upstream_endpoint_stats`, so the requests in flight are also
known per endpoint ("address:port"). An endpoint without a socket address (a spilling pod's
entry in a session cluster, which is an internal listener: listeners.py) is not a pod and
is left out; the requests it forwards are counted in the pool's cluster.

One entry per open LRS stream (an Envoy, one stream each: a newer stream of the same node
replaces the older); it is forgotten when the stream closes, so sums are over the Envoys
connected now. Only clusters the server pushed (`known_clusters`) are kept: a report
naming others has them dropped and counted, so the state stays as small as the config. A
report naming more clusters than that, plus room for the Envoy's own
(`SPARE_REPORT_CLUSTERS`), cannot be an honest one and is refused whole, before any of its
entries is looked at: a flood of made-up names costs its parse, not a Python object per name
(and the garbage collections those bring, which hold the event loop).
This is what flow control needs to see every band's requests in flight across all Envoys,
and the policy to see which pods are busy with long prompts: a subscriber (`subscribe`)
hears of every cluster whose requests in flight per endpoint changed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import load_report_pb2

from xds_server.clock import Clock
from xds_server.telemetry import Telemetry
from xds_server.telemetry.lrs_in_progress import InProgressCollector
from xds_server.xds.cache import NodeHash, by_node_cluster

__all__ = [
    "ClusterLoad",
    "LoadReports",
    "NodeLoad",
    "Rates",
    "ReportObserver",
    "SPARE_REPORT_CLUSTERS",
]

logger = logging.getLogger(__name__)

# Clusters an Envoy may report beyond those the server pushed: its bootstrap's own (the xDS
# cluster, an admin or tracing cluster), with room to spare.
SPARE_REPORT_CLUSTERS = 1000


@dataclass(frozen=True)
class Rates:
    """Requests per second over the last report interval(s), summed over Envoys."""

    successful_per_s: float = 0.0
    issued_per_s: float = 0.0
    errors_per_s: float = 0.0
    # Requests the cluster refused (circuit-breaker overflow) per second.
    dropped_per_s: float = 0.0

    def __add__(self, other: Rates) -> Rates:
        return Rates(
            successful_per_s=self.successful_per_s + other.successful_per_s,
            issued_per_s=self.issued_per_s + other.issued_per_s,
            errors_per_s=self.errors_per_s + other.errors_per_s,
            dropped_per_s=self.dropped_per_s + other.dropped_per_s,
        )


@dataclass(frozen=True)
class ClusterLoad:
    """One cluster in one Envoy's latest report."""

    in_progress: int
    # Requests in flight per endpoint ("address:port"); endpoints with none are left out.
    by_endpoint: Mapping[str, int]
    # Per endpoint, requests issued and requests failed in the report's interval; those
    # with neither are left out. (Envoy counts a request successful at its response
    # headers: a stream that never ends counts as one, so completions are told by the
    # requests in flight: issued, less those still in flight.)
    issued_by_endpoint: Mapping[str, tuple[int, int]]
    rates: Rates
    # The interval the report covers (Envoy's measured load_report_interval), in seconds.
    interval_s: float
    # Monotonic time the report arrived.
    reported_at: float

    @classmethod
    def of(cls, stats: load_report_pb2.ClusterStats, *, now: float) -> ClusterLoad:
        localities = stats.upstream_locality_stats
        interval = stats.load_report_interval.ToNanoseconds() / 1e9

        def rate(total: int) -> float:
            return total / interval if interval > 0 else 0.0

        by_endpoint: dict[str, int] = {}
        issued_failed: dict[str, tuple[int, int]] = {}
        for locality in localities:
            for endpoint in locality.upstream_endpoint_stats:
                in_progress = endpoint.total_requests_in_progress
                issued = endpoint.total_issued_requests
                failed = endpoint.total_error_requests
                if not (in_progress or issued or failed) or not endpoint.address.HasField(
                    "socket_address"
                ):
                    continue
                address = endpoint.address.socket_address
                key = f"{address.address}:{address.port_value}"
                if in_progress:
                    by_endpoint[key] = by_endpoint.get(key, 0) + in_progress
                if issued or failed:
                    before = issued_failed.get(key, (0, 0))
                    issued_failed[key] = (before[0] + issued, before[1] + failed)
        return cls(
            in_progress=sum(s.total_requests_in_progress for s in localities),
            by_endpoint=by_endpoint,
            issued_by_endpoint=issued_failed,
            rates=Rates(
                successful_per_s=rate(sum(s.total_successful_requests for s in localities)),
                issued_per_s=rate(sum(s.total_issued_requests for s in localities)),
                errors_per_s=rate(sum(s.total_error_requests for s in localities)),
                dropped_per_s=rate(stats.total_dropped_requests),
            ),
            interval_s=interval,
            reported_at=now,
        )


class ReportObserver(Protocol):
    """Hears every accepted report as it arrives (the pods' verdicts, verdicts.py): the
    latest figures above are a view, this is the stream of report intervals."""

    def reported(self, node_id: str, loads: Mapping[str, ClusterLoad], now: float) -> None: ...

    def closed(self, node_id: str) -> None: ...


@dataclass
class NodeLoad:
    """What one LRS stream (one Envoy) reported last (mutable; updated per report)."""

    stream_id: int
    node_id: str
    group: str
    clusters: dict[str, ClusterLoad] = field(default_factory=dict)
    reports: int = 0
    # Reports refused whole: they named more clusters than an honest Envoy could.
    refused_reports: int = 0


class LoadReports:
    """The latest load report of every connected Envoy, and sums over them.

    Mutable state: `_nodes` (stream id -> NodeLoad). Everything runs on one event loop; the
    LRS streams (load_stats.py) call `open`, `report` and `close`. The subscriber is called
    with the clusters whose requests in flight per endpoint a report (or a closed stream)
    changed.
    """

    def __init__(
        self,
        telemetry: Telemetry,
        *,
        node_hash: NodeHash = by_node_cluster,
        clock: Clock = time.monotonic,
        known_clusters: Callable[[], Set[str]] | None = None,
    ) -> None:
        self._telemetry = telemetry
        self._node_hash = node_hash
        self._clock = clock
        self._known_clusters = known_clusters
        self._on_change: Callable[[Set[str]], None] | None = None
        self._observer: ReportObserver | None = None
        self._nodes: dict[int, NodeLoad] = {}
        # Grows whenever a node's figures change (not with a report that repeats the last).
        self.revision = 0
        # Per cluster, over every report since the server started: [issued, dropped].
        self._totals: dict[str, list[int]] = {}
        telemetry.registry.register(InProgressCollector(self))

    # -- updates (from the LRS streams) ----------------------------------------------------

    def subscribe(self, on_change: Callable[[Set[str]], None]) -> None:
        """Call `on_change` with the clusters whose figures changed, from now on (one
        listener: the controller, which is built after this and reads it)."""
        self._on_change = on_change

    def observe(self, observer: ReportObserver) -> None:
        """Hand every accepted report to `observer` from now on (one: the verdicts)."""
        self._observer = observer

    def open(self, stream_id: int, node: base_pb2.Node) -> NodeLoad:
        """Start tracking the Envoy `node` on stream `stream_id`."""
        entry = NodeLoad(stream_id=stream_id, node_id=node.id, group=self._node_hash(node))
        # One stream per Envoy: a node that opens another (a reconnect) is its newest.
        for older in [e for e in self._nodes.values() if e.node_id == node.id]:
            self.close(older.stream_id)
        self._nodes[stream_id] = entry
        self.revision += 1
        self._telemetry.lrs_streams.inc()
        return entry

    def report(self, stream_id: int, clusters: Sequence[load_report_pb2.ClusterStats]) -> None:
        """Record one report of stream `stream_id`; clusters absent from it keep their last."""
        entry = self._nodes.get(stream_id)
        if entry is None:
            return
        now = self._clock()
        changed = set()
        known = self._known_clusters() if self._known_clusters is not None else None
        if known is not None:
            if len(clusters) > len(known) + SPARE_REPORT_CLUSTERS:
                self._refuse(entry, len(clusters), len(known))
                return
            kept = [stats for stats in clusters if stats.cluster_name in known]
            if len(kept) < len(clusters):
                self._telemetry.lrs_unknown_clusters.inc(len(clusters) - len(kept))
            clusters = kept
            for name in [n for n in self._totals if n not in known]:
                del self._totals[name]
        loads: dict[str, ClusterLoad] = {}
        for stats in clusters:
            load = loads[stats.cluster_name] = ClusterLoad.of(stats, now=now)
            previous = entry.clusters.get(stats.cluster_name)
            if load.by_endpoint != (previous.by_endpoint if previous is not None else {}):
                changed.add(stats.cluster_name)
            if previous is None or (load.in_progress, load.rates, load.by_endpoint) != (
                previous.in_progress,
                previous.rates,
                previous.by_endpoint,
            ):
                self.revision += 1
            entry.clusters[stats.cluster_name] = load
            totals = self._totals.setdefault(stats.cluster_name, [0, 0])
            totals[0] += sum(s.total_issued_requests for s in stats.upstream_locality_stats)
            # Requests the cluster refused: circuit-breaker overflow (and drop_overload).
            totals[1] += stats.total_dropped_requests
        entry.reports += 1
        self._telemetry.lrs_reports.inc()
        if self._observer is not None:
            self._observer.reported(entry.node_id, loads, now)
        self._changed(changed)

    def _refuse(self, entry: NodeLoad, named: int, known: int) -> None:
        entry.refused_reports += 1
        self._telemetry.lrs_refused_reports.inc()
        # Once per stream at warning level: a flood must not become a flood of log lines.
        log = logger.warning if entry.refused_reports == 1 else logger.debug
        log(
            "Refused a load report of node %r (LRS stream %d): it names %d clusters, more than"
            " the %d the server pushed plus %d; the node's last good report stands.",
            entry.node_id, entry.stream_id, named, known, SPARE_REPORT_CLUSTERS,
        )  # fmt: skip

    def close(self, stream_id: int) -> None:
        """Forget the Envoy of stream `stream_id` (its stream closed)."""
        entry = self._nodes.pop(stream_id, None)
        if entry is not None:
            if self._observer is not None:
                self._observer.closed(entry.node_id)
            self.revision += 1
            self._telemetry.lrs_streams.dec()
            self._changed({name for name, load in entry.clusters.items() if load.by_endpoint})

    def _changed(self, clusters: Set[str]) -> None:
        if clusters and self._on_change is not None:
            self._on_change(frozenset(clusters))

    # -- queries ---------------------------------------------------------------------------

    def _loads(self, cluster: str, group: str | None) -> Iterator[ClusterLoad]:
        # A copy (atomic under the GIL): /metrics reads this from a worker thread.
        for entry in list(self._nodes.values()):
            if group is None or entry.group == group:
                load = entry.clusters.get(cluster)
                if load is not None:
                    yield load

    def in_progress(self, cluster: str, *, group: str | None = None) -> int:
        """Requests in flight on `cluster` over the connected Envoys (of `group`; None: all)."""
        return sum(load.in_progress for load in self._loads(cluster, group))

    def in_progress_by_endpoint(
        self, cluster: str, *, group: str | None = None, excluding: Set[str] = frozenset()
    ) -> dict[str, int]:
        """Requests in flight on `cluster` per endpoint ("address:port"), summed over the
        connected Envoys (of `group`; None: all) but those whose node id is in `excluding`;
        endpoints with none are left out."""
        total: dict[str, int] = {}
        for entry in list(self._nodes.values()):
            load = entry.clusters.get(cluster)
            if load is None or entry.node_id in excluding:
                continue
            if group is None or entry.group == group:
                for key, count in load.by_endpoint.items():
                    total[key] = total.get(key, 0) + count
        return total

    def rates(self, cluster: str, *, group: str | None = None) -> Rates:
        """Request rates of `cluster`, summed over the connected Envoys (of `group`)."""
        return sum((load.rates for load in self._loads(cluster, group)), Rates())

    def admitted(self, clusters: list[str]) -> int:
        """Requests sent upstream by `clusters` over every report since the server started."""
        return sum(self._totals.get(c, (0, 0))[0] for c in clusters)

    def refused(self, clusters: list[str]) -> int:
        """Requests `clusters` refused (overflow) over every report since the server started."""
        return sum(self._totals.get(c, (0, 0))[1] for c in clusters)

    def nodes(self, group: str | None = None) -> list[NodeLoad]:
        """The connected Envoys (of `group`; None: all) and their latest reports."""
        return [e for e in self._nodes.values() if group is None or e.group == group]

    def clusters(self) -> frozenset[str]:
        """Every cluster some connected Envoy reports."""
        return frozenset(name for e in list(self._nodes.values()) for name in list(e.clusters))

    def to_json(self) -> list[dict[str, object]]:
        """For /debug: per connected Envoy, its latest figures per cluster and their age."""
        now = self._clock()
        return [
            {
                "stream_id": e.stream_id,
                "node_id": e.node_id,
                "group": e.group,
                "reports": e.reports,
                "refused_reports": e.refused_reports,
                "clusters": {
                    name: {
                        "in_progress": load.in_progress,
                        "in_progress_by_endpoint": dict(sorted(load.by_endpoint.items())),
                        "successful_per_s": load.rates.successful_per_s,
                        "issued_per_s": load.rates.issued_per_s,
                        "errors_per_s": load.rates.errors_per_s,
                        "interval_s": load.interval_s,
                        "age_s": round(now - load.reported_at, 3),
                    }
                    for name, load in sorted(e.clusters.items())
                },
            }
            for e in self._nodes.values()
        ]
