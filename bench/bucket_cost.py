"""What keeping a pool's key buckets costs a decision, at fleet size (policy/buckets.py).

Each pool has `--pods` pods in rotation and 1,024 logged keys (the session-key log's bound
per pool), each served by a random pod; every decision pins, reweighs the spares and offers
the unpinned buckets on the ring of the spares. Two cases per pool size: the keys' counts
change each decision but the spares stay (the ring is cached), and the spares change each
decision (a pod leaves them, so the ring is built anew, and a tenth of the pods, others
each time, took a key's first request lately). It reports the median and the
longest decision, which is time the event loop is held per pool and decision.

    python -m bench.bucket_cost [--pods 4,100,1000] [--buckets 256,1024] [--decisions 50]
        [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from xds_server.policy.buckets import BucketMemory, bucket_homes
from xds_server.tuning import Tuning

__all__ = ["bucket_cost", "main"]

KEYS = 1024


def bucket_cost(pods: int, buckets: int, decisions: int, *, churn: bool) -> dict[str, float]:
    """Milliseconds per decision of one pool of `pods` pods with `buckets` buckets; with
    `churn`, the spares change every decision (one pod is always spilling, another each
    time, and every tenth pod from another one on took a key's first request)."""
    tuning = Tuning()
    rng = random.Random(pods * buckets)
    ids = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(pods)]
    keys = [rng.getrandbits(64) for _ in range(KEYS)]
    served = {k: rng.choice(ids) for k in keys}
    shares = dict.fromkeys(ids, 1.0)
    memory = BucketMemory()
    held = []
    for n in range(decisions):
        counts = {k: float(rng.randrange(1, 20)) for k in keys}
        spilling = frozenset({ids[n % pods]}) if churn else frozenset()
        firsts = {ids[(n + i) % pods]: 1 for i in range(0, pods, 10)} if churn else {}
        started = time.perf_counter()
        table = bucket_homes(
            frozenset(ids),
            ids,
            shares,
            counts,
            served,
            spilling,
            memory,
            buckets=buckets,
            key_prior=tuning.home_key_prior,
            offer_points=tuning.key_offer_points,
            offer_width=tuning.key_offer_width,
            spare_slack=tuning.key_spare_slack,
            first_requests=firsts,
        )
        held.append(time.perf_counter() - started)
        memory = table.memory
    return {
        "pods": pods,
        "buckets": buckets,
        "spares_change": churn,
        "decision_ms_median": statistics.median(held) * 1000,
        "decision_ms_max": max(held) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bucket_cost", description=__doc__)
    parser.add_argument("--pods", default="4,100,1000")
    parser.add_argument("--buckets", default="256,1024")
    parser.add_argument("--decisions", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    results = [
        bucket_cost(int(p), int(b), options.decisions, churn=churn)
        for p in options.pods.split(",")
        for b in options.buckets.split(",")
        for churn in (False, True)
    ]
    if options.json:
        print(json.dumps({"bucket_cost": results}, indent=1))
    else:
        for r in results:
            spares = "spares changing" if r["spares_change"] else "spares steady"
            print(
                f"{r['pods']} pods, {r['buckets']} buckets, {KEYS} keys, {spares}: decision"
                f" median {r['decision_ms_median']:.2f} ms, longest {r['decision_ms_max']:.2f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
