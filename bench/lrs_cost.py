"""What one Envoy's load report costs the server, at fleet size.

Each Envoy reports every `load_report_interval_s` (0.25 s) on every cluster the server
pushed (`send_all_clusters`): with flow control, a pool is four clusters (its own and one
per band), so 100 pools make a 400-cluster report. This times `LoadReports.report` (what
the LRS stream does with a decoded report) on such a report, and says how many Envoys' reports
one core reads at the interval: the figure behind the sizing of load reports in docs/operations.md.

    python -m bench.lrs_cost [--pools 100] [--reports 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import load_report_pb2

from xds_server.telemetry import Telemetry
from xds_server.xds.load_reports import LoadReports

__all__ = ["lrs_cost", "main"]

_BANDS = ("", "/critical", "/standard", "/sheddable")


def lrs_cost(*, pools: int, reports: int, interval_s: float = 0.25) -> dict[str, float]:
    """CPU seconds per report of `pools` x 4 clusters, and Envoys per core at `interval_s`."""
    names = [f"pool-{p:03d}{band}" for p in range(pools) for band in _BANDS]
    stats = []
    for name in names:
        cluster = load_report_pb2.ClusterStats(cluster_name=name)
        cluster.load_report_interval.FromNanoseconds(int(interval_s * 1e9))
        locality = cluster.upstream_locality_stats.add()
        locality.total_issued_requests = 3
        stats.append(cluster)
    known = frozenset(names)
    store = LoadReports(Telemetry(), clock=time.monotonic, known_clusters=lambda: known)
    store.open(1, base_pb2.Node(id="envoy", cluster="bench"))
    started = time.process_time()
    for _ in range(reports):
        store.report(1, stats)
    per_report = (time.process_time() - started) / reports
    return {
        "clusters_per_report": float(len(names)),
        "cpu_ms_per_report": per_report * 1e3,
        "envoys_per_core": interval_s / per_report,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lrs_cost", description=__doc__)
    parser.add_argument("--pools", type=int, default=100)
    parser.add_argument("--reports", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = lrs_cost(pools=args.pools, reports=args.reports)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['cpu_ms_per_report']:.2f} ms of CPU per report of"
            f" {result['clusters_per_report']:.0f} clusters: one core reads"
            f" {result['envoys_per_core']:.0f} Envoys' reports every 0.25 s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
