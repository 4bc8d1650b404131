"""Groups new to a pod after the warm-up, per policy: brand new, split, or moved; and where
they landed.

For each request after the 16 s warm-up whose prefix group had not been served by its pod
before: brand new (the group's first request of the seed), split (the group was served
elsewhere within 2 s: a burst of one new key spread before its bucket was pinned), or
moved (served elsewhere earlier than that: a spill, or a home that changed). And, from the
client's side: how many requests were still waiting for their first token on its pod when
it was sent (prefills ahead), how many of those were themselves a group's first request
on that pod (first requests ahead: whole prefills), and how many pods had fewer requests
in flight (its rank, 0 for the pod with the fewest).

    cd bench/results/bucket-homes && python split_groups.py RUN SCENARIO SEEDS
    python split_groups.py fewest-in-flight-c-more-prefixes-seeds-4-8 c@more-prefixes 4,5,6,7,8
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WARM_UP_S = 16.0
SPLIT_S = 2.0
POLICIES = ("project", "vllm_router_sticky_least_loaded")


def _on(results: list[dict[str, float | str]], pod: str, at: float, until: str) -> int:
    """Requests on `pod` sent before `at` and not yet at `until` (ttft_s or e2e_s) by then."""
    return sum(
        1
        for r in results
        if r["backend_id"] == pod
        and float(r["scheduled_at_s"]) < at < float(r["scheduled_at_s"]) + float(r[until])
    )


def placed(run: Path, scenario: str, seed: int, policy: str) -> list[tuple[int, int, int]]:
    """Each group new to a pod after the warm-up: prefills ahead of it, first requests
    ahead of it, its pod's rank."""
    lines = (run / "traces" / f"{scenario}-seed{seed}.jsonl").read_text().splitlines()[1:]
    group = {r["index"]: r["prefix_group"] for r in map(json.loads, lines)}
    path = run / "traces" / f"{scenario}-seed{seed}-{policy}-results.json"
    results = sorted(json.loads(path.read_text())["results"], key=lambda r: r["scheduled_at_s"])
    pods = sorted({r["backend_id"] for r in results})
    seen: set[tuple[int, str]] = set()
    firsts = []
    for r in results:
        if (group[r["index"]], r["backend_id"]) not in seen:
            firsts.append(r)
        seen.add((group[r["index"]], r["backend_id"]))
    out = []
    for r in firsts:
        pod, at = r["backend_id"], r["scheduled_at_s"]
        if at >= WARM_UP_S:
            mine = _on(results, pod, at, "e2e_s")
            rank = sum(_on(results, p, at, "e2e_s") < mine for p in pods)
            out.append((_on(results, pod, at, "ttft_s"), _on(firsts, pod, at, "ttft_s"), rank))
    return out


def firsts(run: Path, scenario: str, seed: int, policy: str) -> tuple[int, int, int]:
    lines = (run / "traces" / f"{scenario}-seed{seed}.jsonl").read_text().splitlines()[1:]
    group = {r["index"]: r["prefix_group"] for r in map(json.loads, lines)}
    path = run / "traces" / f"{scenario}-seed{seed}-{policy}-results.json"
    results = sorted(json.loads(path.read_text())["results"], key=lambda r: r["scheduled_at_s"])
    pods: dict[int, set[str]] = {}
    last: dict[int, float] = {}
    new = split = moved = 0
    for r in results:
        g, pod, at = group[r["index"]], r["backend_id"], r["scheduled_at_s"]
        served = pods.setdefault(g, set())
        if pod not in served:
            if at >= WARM_UP_S:
                if not served:
                    new += 1
                elif at - last[g] < SPLIT_S:
                    split += 1
                else:
                    moved += 1
            served.add(pod)
        last[g] = at
    return new, split, moved


def main() -> None:
    run, scenario = Path(sys.argv[1]), sys.argv[2]
    seeds = [int(s) for s in sys.argv[3].split(",")]
    for policy in POLICIES:
        counts = [firsts(run, scenario, seed, policy) for seed in seeds]
        new, split, moved = (sum(c[i] for c in counts) for i in range(3))
        print(f"{policy}: brand new {new}, split {split}, moved {moved}")
        landed = [x for seed in seeds for x in placed(run, scenario, seed, policy)]
        ahead = sum(a for a, _, _ in landed) / len(landed)
        whole = sum(1 for _, f, _ in landed if f)
        ranks = [sum(1 for _, _, k in landed if k == rank) for rank in range(4)]
        print(
            f"  {len(landed)} new to their pod: {ahead:.2f} prefills ahead, {whole} behind"
            f" another group's first request there, pods by rank {ranks}"
        )


if __name__ == "__main__":
    main()
