"""An offline model of scenario c's placed key homes, through the server's own placement.

Prefix groups of equal popularity arrive at c's rate over four pods of equal capacity; each
group's requests go to its home in the session table (xds_server/maglev.py, with the
server's ring weights), and every `WINDOW_S` the placement (xds_server/policy/homes.py)
sees the groups logged so far, their counts decayed as xds/session_keys.py decays them.
Measured after the 16 s warm-up, as the benchmark does:

- moved-key misses: requests of a group whose home moved since its last request (a
  group's first request is a miss for every policy and is not counted);
- the largest |share / capacity share - 1| of the requests the pods would serve by their
  homes (every group's expected requests at each arrival, so that which group came next
  adds no noise);
- `sticky`: each group homed at its first request on the pod with the fewest groups, as
  vllm-router's sticky_least_loaded does (no move, ever).

The run is the benchmark's: 48 s of arrivals, measured after 16 s. Queueing, spills and
the prefix caches' size are left out. Arguments: runs, groups, requests/s, and tuning
overrides as JSON; run from a worktree to compare rules:
`PYTHONPATH=<worktree> python bench/results/homes-few-moves/model.py 200 32 6.67 '{}'`.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Mapping

from xds_server.maglev import key_hash, maglev_table, table_size
from xds_server.policy.homes import HomeMemory, LoggedKeys, balanced_homes
from xds_server.policy.signals import PodSignals
from xds_server.policy.weights import quantize
from xds_server.tuning import MAX_WEIGHT, Tuning

RUN_S, WARM_UP_S, WINDOW_S, HALF_LIFE_S = 48.0, 16.0, 2.6, 60.0
PODS = ("p0", "p1", "p2", "p3")


def run(seed: int, groups: int, rate: float, *, sticky: bool, tuning: Tuning) -> tuple[int, float]:
    """One run: the moved-key misses after the warm-up and the largest per-pod deviation."""
    rng = random.Random(seed)
    names = {k: f"ns/pod-{rng.getrandbits(32):08x}" for k in PODS}

    def weights(factors: Mapping[str, float]) -> dict[str, int]:
        top = max(factors.get(k, 1.0) for k in PODS)
        return {
            k: quantize(MAX_WEIGHT * factors.get(k, 1.0) / top, tuning.weight_ladder) for k in PODS
        }

    by_name = {v: k for k, v in names.items()}
    tables: dict[tuple[tuple[str, float], ...], Callable[[int], str]] = {}

    def homes(factors: Mapping[str, float]) -> Callable[[int], str]:
        key = tuple(sorted(factors.items()))
        if key not in tables:
            table = maglev_table({names[k]: w for k, w in weights(factors).items()}, table_size(4))
            tables[key] = lambda hashed: by_name[table.host_of(hashed)]
        return tables[key]

    hashes = [key_hash(f"group-{seed}-{i}") for i in range(groups)]
    fresh = {k: PodSignals(silent_s=0.0, waiting=0.0, running=4.0) for k in PODS}
    decay = math.log(2) / HALF_LIFE_S
    counts: dict[int, tuple[float, float]] = {}
    memory, last, served = HomeMemory(), dict[int, str](), Counter[str]()
    misses, now, window = 0, 0.0, WINDOW_S
    while (now := now + rng.expovariate(rate)) <= RUN_S:
        while now >= window:
            if counts and not sticky:
                logged = {h: c * math.exp(-decay * (window - at)) for h, (c, at) in counts.items()}
                keys = LoggedKeys(counts=logged, names=names, size=table_size(4), weights=weights)
                # The window's last decision: a busy pool, no pod spilling.
                ending = HomeMemory(
                    factors=memory.factors,
                    ratios=memory.ratios,
                    load=dict.fromkeys(PODS, 4.0),
                    spills=dict.fromkeys(PODS, 0),
                    samples=round(tuning.home_window_intervals) - 1,
                )
                equal = dict.fromkeys(PODS, 1.0)
                memory = balanced_homes(PODS, fresh, equal, set(), ending, tuning, keys).memory
            window += WINDOW_S
        hashed = hashes[rng.randrange(groups)]
        if sticky:
            if hashed not in last:
                held = Counter(last.values())
                last[hashed] = min(PODS, key=lambda k: (held[k], rng.random()))
            pod = last[hashed]
        else:
            pod = homes(memory.factors)(hashed)
            misses += hashed in last and last[hashed] != pod and now >= WARM_UP_S
            last[hashed] = pod
        count, at = counts.get(hashed, (0.0, now))
        counts[hashed] = (count * math.exp(-decay * (now - at)) + 1.0, now)
        if now >= WARM_UP_S:
            home = homes(memory.factors)
            for other in hashes:
                served[last.get(other, "") if sticky and other in last else home(other)] += 1
    total = sum(served.values())
    return misses, max(abs(served[k] / total * len(PODS) - 1) for k in PODS)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    groups = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    rate = float(sys.argv[3]) if len(sys.argv) > 3 else 6.67
    tuning = Tuning().with_overrides(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
    print(f"{runs} runs, {groups} groups at {rate} requests/s over 4 pods")
    for label, sticky in (("placed", False), ("sticky", True)):
        results = [run(s, groups, rate, sticky=sticky, tuning=tuning) for s in range(runs)]
        misses = [m for m, _ in results]
        spread = sorted(d for _, d in results)
        print(
            f"{label}: moved-key misses a run {statistics.mean(misses):.2f}"
            f" (runs with 2 or more: {sum(m >= 2 for m in misses)}/{runs});"
            f" largest per-pod deviation median {statistics.median(spread):.2f},"
            f" 90th percentile {spread[int(0.9 * runs)]:.2f}, max {spread[-1]:.2f}"
        )


if __name__ == "__main__":
    main()
