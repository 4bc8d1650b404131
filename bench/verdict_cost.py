"""What judging pods from the load reports costs the server, at fleet size.

The pods' verdicts (xds_server/verdicts.py) read every accepted load report: per report,
each endpoint entry is added to its pod's pending figures; once per 0.25 s, whatever the
number of Envoys, the pods reported on are folded in and judged. This times both on
`pools` x `pods` endpoints, every pod busy in every report (an Envoy that sends every pod
requests: the worst case per report), and the per-pool views a decision reads.

    python -m bench.verdict_cost [--pools 100] [--pods 100] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from xds_server.config import RoutingConfig
from xds_server.verdicts import EVALUATE_S, PodVerdicts
from xds_server.xds.load_reports import ClusterLoad, Rates

__all__ = ["main", "verdict_cost"]


def _config(pools: int, pods: int) -> RoutingConfig:
    return RoutingConfig.model_validate(
        {
            "pools": [
                {
                    "name": f"pool-{p:03d}",
                    "models": [f"model-{p:03d}"],
                    "endpoints": [
                        {"address": f"10.{p // 250}.{p % 250}.{i % 250}", "port": 8000 + i // 250}
                        for i in range(pods)
                    ],
                }
                for p in range(pools)
            ]
        }
    )


def _report(config: RoutingConfig, now: float) -> dict[str, ClusterLoad]:
    loads = {}
    for pool in config.pools:
        keys = [f"{e.address}:{e.port}" for e in pool.endpoints]
        loads[pool.name] = ClusterLoad(
            in_progress=2 * len(keys),
            by_endpoint=dict.fromkeys(keys, 2),
            issued_by_endpoint=dict.fromkeys(keys, (1, 0)),
            rates=Rates(),
            interval_s=EVALUATE_S,
            reported_at=now,
        )
    return loads


def verdict_cost(*, pools: int, pods: int, ticks: int = 8, envoys: int = 4) -> dict[str, float]:
    """CPU ms per report of `pools` x `pods` busy endpoints (`envoys` reports per 0.25 s,
    the first of each tick folding in and judging), and of the views for a decision."""
    config = _config(pools, pods)
    clock = [0.0]
    verdicts = PodVerdicts(lambda: config, clock=lambda: clock[0])
    reports = [_report(config, tick * EVALUATE_S) for tick in range(ticks)]
    adding = judging = 0.0
    for tick, loads in enumerate(reports):
        for envoy in range(envoys):
            clock[0] = tick * EVALUATE_S + envoy * 1e-3
            started = time.process_time()
            verdicts.reported(f"envoy-{envoy}", loads, clock[0])
            spent = time.process_time() - started
            if envoy == 0:
                judging += spent
            else:
                adding += spent
    # The views after a change (made once, then read per pool), without a collection of
    # the reports' garbage landing in them.
    gc.collect()
    gc.disable()
    try:
        started = time.process_time()
        for pool in config.pools:
            verdicts.of_pool(pool.name)
            verdicts.slowness_of_pool(pool.name)
        views = time.process_time() - started
    finally:
        gc.enable()
    return {
        "endpoints": float(pools * pods),
        "cpu_ms_per_report": adding / (ticks * (envoys - 1)) * 1e3,
        "cpu_ms_per_evaluation": (judging / ticks) * 1e3,
        "cpu_ms_views": views * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.verdict_cost", description=__doc__)
    parser.add_argument("--pools", type=int, default=100)
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = verdict_cost(pools=args.pools, pods=args.pods)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['endpoints']:.0f} busy endpoints: {result['cpu_ms_per_report']:.1f} ms"
            f" of CPU per report, {result['cpu_ms_per_evaluation']:.1f} ms per evaluation"
            f" (one per {EVALUATE_S} s, with a report), {result['cpu_ms_views']:.1f} ms for"
            " a decision's views"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
