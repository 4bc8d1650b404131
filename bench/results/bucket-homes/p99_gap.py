"""c's pooled P95 / P99 TTFT, project against sticky_least_loaded, seeds 4-13, and how sure.

(And c@more-prefixes, seeds 4-8: with the cold-start rule for affinity that NOTES.md
describes, tried and not kept; and with affinity judged per return, in two runs of the
same placement and one with `key_spare_slack` 1, each beside the router; and c96. And the
steps to new keys by fewest in flight, on both; and new keys passing over the pods that
just took a key's first request, with the default slack and with 2, and on c96's seeds
9-13 with it on and off.)

Reads the kept runs' traces (requests after the 16 s warm-up). With hash homes: the
project's from bounded-load's c-seeds-4-8-off and c-seeds-9-13-off, the router's from
c-seeds-4-8-off (the run beside the project's) and c-seeds-9-13-factor-300. With key
buckets: both from this folder's c-seeds-4-8 and c-seeds-9-13 (the router beside the
project in each); with the unpinned buckets offered to one spare each, from
width1-c-seeds-4-8 and width1-c-seeds-9-13. A paired bootstrap over the seeds resamples
the ten seeds with replacement and takes both policies' pooled P99 over each resample,
so a seed whose requests are slow for both counts for both.

    cd bench/results/bucket-homes && python p99_gap.py
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
HASH = HERE.parent / "bounded-load"
WARM_UP_S = 16.0
RESAMPLES = 4000
PROJECT, ROUTER = "project", "vllm_router_sticky_least_loaded"
FIRST, SECOND = (4, 5, 6, 7, 8), (9, 10, 11, 12, 13)


def ttfts(run: Path, policy: str, seed: int, scenario: str = "c") -> list[float]:
    path = run / "traces" / f"{scenario}-seed{seed}-{policy}-results.json"
    results = json.loads(path.read_text())["results"]
    return [r["ttft_s"] or 0.0 for r in results if r["scheduled_at_s"] >= WARM_UP_S]


def percentile(values: list[float], q: int) -> float:
    """Nearest rank, as the benchmark's pooled tables."""
    ordered = sorted(values)
    return ordered[max(0, -(-q * len(ordered) // 100) - 1)]


def main() -> None:
    report(
        "hash homes",
        {s: HASH / "c-seeds-4-8-off" for s in FIRST}
        | {s: HASH / "c-seeds-9-13-off" for s in SECOND},
        {s: HASH / "c-seeds-4-8-off" for s in FIRST}
        | {s: HASH / "c-seeds-9-13-factor-300" for s in SECOND},
    )
    buckets = {s: HERE / "c-seeds-4-8" for s in FIRST} | {s: HERE / "c-seeds-9-13" for s in SECOND}
    report("key buckets", buckets, buckets)
    offers = {s: HERE / "width1-c-seeds-4-8" for s in FIRST} | {
        s: HERE / "width1-c-seeds-9-13" for s in SECOND
    }
    report("key buckets with offers", offers, offers)
    more = "c@more-prefixes"
    report(
        f"{more}, key buckets, affinity's cold-start rule (router from the width-1 run)",
        dict.fromkeys(FIRST, HERE / "cold-start-c-more-prefixes-seeds-4-8"),
        dict.fromkeys(FIRST, HERE / "width1-c-more-prefixes-seeds-4-8"),
        scenario=more,
    )
    for run in (
        "returns-c-more-prefixes-seeds-4-8",
        "per-finished-c-more-prefixes-seeds-4-8",
        "returns-slack1-c-more-prefixes-seeds-4-8",
        "full-scan-c-more-prefixes-seeds-4-8",
        "all-pods-c-more-prefixes-seeds-4-8",
        "fewest-in-flight-c-more-prefixes-seeds-4-8",
        "slack2-c-more-prefixes-seeds-4-8",
        "first-requests-c-more-prefixes-seeds-4-8",
        "first-requests-slack2-c-more-prefixes-seeds-4-8",
    ):
        runs = dict.fromkeys(FIRST, HERE / run)
        report(f"{more} ({run})", runs, runs, scenario=more)
    for run in ("fewest-in-flight-c-seeds-4-8", "slack2-c-seeds-4-8", "first-requests-c-seeds-4-8"):
        runs = dict.fromkeys(FIRST, HERE / run)
        report(f"c ({run})", runs, runs)
    for run in (
        "returns-c96-seeds-4-8",
        "fewest-in-flight-c96-seeds-4-8",
        "buckets1024-c96-seeds-4-8",
        "first-requests-c96-seeds-4-8",
        "first-requests-slack2-c96-seeds-4-8",
    ):
        runs = dict.fromkeys(FIRST, HERE / run)
        report(f"c96 ({run})", runs, runs, scenario="c96")
    for run in ("first-requests-c96-seeds-9-13", "first-requests-off-c96-seeds-9-13"):
        runs = dict.fromkeys(SECOND, HERE / run)
        report(f"c96 ({run})", runs, runs, scenario="c96")


def report(
    label: str,
    project_runs: dict[int, Path],
    router_runs: dict[int, Path],
    *,
    scenario: str = "c",
) -> None:
    project = {s: ttfts(run, PROJECT, s, scenario) for s, run in project_runs.items()}
    router = {s: ttfts(run, ROUTER, s, scenario) for s, run in router_runs.items()}
    seeds = sorted(project)

    def pooled(by_seed: dict[int, list[float]], pick: list[int], q: int = 99) -> float:
        return percentile([t for s in pick for t in by_seed[s]], q)

    print(
        f"{label}, pooled P95 / P99 over seeds {seeds[0]}-{seeds[-1]}: project"
        f" {1000 * pooled(project, seeds, 95):.0f} / {1000 * pooled(project, seeds):.0f} ms,"
        f" router {1000 * pooled(router, seeds, 95):.0f} / {1000 * pooled(router, seeds):.0f} ms"
    )
    for q in (99, 95):
        rng = random.Random(1)
        gaps = []
        for _ in range(RESAMPLES):
            pick = [rng.choice(seeds) for _ in seeds]
            gaps.append(pooled(project, pick, q) - pooled(router, pick, q))
        gaps.sort()
        low, high = gaps[RESAMPLES // 20], gaps[RESAMPLES - RESAMPLES // 20]
        print(
            f"  P{q}, project minus router, paired bootstrap over seeds: median"
            f" {1000 * statistics.median(gaps):+.0f} ms, 5th-95th percentile"
            f" {1000 * low:+.0f} to {1000 * high:+.0f} ms,"
            f" zero or less in {sum(g <= 0 for g in gaps) / RESAMPLES:.0%} of resamples"
        )


if __name__ == "__main__":
    main()
