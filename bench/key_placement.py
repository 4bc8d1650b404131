"""What placing logged session keys costs and buys: pools of random pod names, 8 keys a
pod, each key seen three times (none still to come), placed in one window
(xds_server/policy/homes.py).

For each pool size it reports, over `--trials` pools: the share of pools whose keys fall
within `home_tolerance` plus one key (the placement's trigger) of the pods' shares with
Maglev's hash alone and after one window of placing, how many keys moved, and how long the
window's search held the event loop.

    python -m bench.key_placement [--pods 4,8] [--trials 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Mapping

from xds_server.maglev import key_hash, maglev_table, table_size
from xds_server.policy.homes import HomeMemory, LoggedKeys, balanced_homes
from xds_server.policy.signals import PodSignals
from xds_server.policy.weights import quantize
from xds_server.tuning import MAX_WEIGHT, Tuning

__all__ = ["key_placement", "main"]

KEYS_PER_POD = 8


def _pool(pods: int, trial: int, tuning: Tuning) -> tuple[list[str], LoggedKeys]:
    rng = random.Random(trial)
    ids = [f"10.0.{trial}.{i}:8000" for i in range(pods)]
    names = {k: f"ns/pod-{rng.getrandbits(32):08x}" for k in ids}

    def weights(factors: Mapping[str, float]) -> dict[str, int]:
        top = max(factors.get(k, 1.0) for k in ids)
        return {
            k: quantize(MAX_WEIGHT * factors.get(k, 1.0) / top, tuning.weight_ladder) for k in ids
        }

    counts = {key_hash(f"key-{trial}-{i}"): 3.0 for i in range(KEYS_PER_POD * pods)}
    return ids, LoggedKeys(counts=counts, names=names, size=table_size(pods), weights=weights)


def _deviation(
    ids: list[str], keys: LoggedKeys, factors: Mapping[str, float]
) -> tuple[float, dict[int, str]]:
    table = maglev_table({keys.names[k]: w for k, w in keys.weights(factors).items()}, keys.size)
    homes = {h: table.host_of(h) for h in keys.counts}
    count = Counter(homes.values())
    return max(abs(count[keys.names[k]] / KEYS_PER_POD - 1) for k in ids), homes


def key_placement(pods: int, trials: int, tuning: Tuning) -> dict[str, float]:
    within_hash = within_placed = 0
    moved: list[int] = []
    held: list[float] = []
    trigger = tuning.home_tolerance + 1 / KEYS_PER_POD
    for trial in range(trials):
        ids, keys = _pool(pods, trial, tuning)
        busy = {k: PodSignals(silent_s=0.0, waiting=0.0, running=4.0) for k in ids}
        shares = dict.fromkeys(ids, 1.0)
        memory = HomeMemory()
        for _ in range(round(tuning.home_window_intervals)):
            started = time.perf_counter()
            memory = balanced_homes(ids, busy, shares, frozenset(), memory, tuning, keys).memory
            held.append(time.perf_counter() - started)
        before, start = _deviation(ids, keys, {})
        after, end = _deviation(ids, keys, memory.factors)
        within_hash += before <= trigger + 1e-9
        within_placed += after <= trigger + 1e-9
        moved.append(sum(start[h] != end[h] for h in keys.counts))
    return {
        "pods": pods,
        "keys": KEYS_PER_POD * pods,
        "trials": trials,
        "within_tolerance_hash": within_hash / trials,
        "within_tolerance_placed": within_placed / trials,
        "keys_moved_median": statistics.median(moved),
        "keys_moved_max": max(moved),
        "decision_ms_max": max(held) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.key_placement", description=__doc__)
    parser.add_argument("--pods", default="4,8")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    tuning = Tuning()
    results = [key_placement(int(p), options.trials, tuning) for p in options.pods.split(",")]
    if options.json:
        print(json.dumps({"key_placement": results}, indent=1))
    else:
        for r in results:
            print(
                f"{r['pods']} pods, {r['keys']} keys, {r['trials']} pools: within tolerance and"
                f" a key"
                f" {r['within_tolerance_hash']:.0%} by hash, {r['within_tolerance_placed']:.0%}"
                f" after one window; keys moved median {r['keys_moved_median']:g}, max"
                f" {r['keys_moved_max']}; longest decision {r['decision_ms_max']:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
