"""The slow requests of a c run after its warm-up, and why: read from the run's traces.

For each seed and policy: every request after the 16 s warm-up whose TTFT is over 0.3 s
(a 2,048-token prefill takes about 0.45 s), marked `first` (its group's first request in
the run), `move` (its group's pod changed and stayed changed), `spill` (its group's pod
changed for this request only, or for its last request in the run: nothing shows it
stayed) or `queued` (on its group's pod, behind another prefill).
Where the run kept the server's decisions (`<run>-queues.json`, from 7e7eb4b), a request
sent off its group's pod while that pod spilled in the server's decision is `spill` too,
whatever follows.

    cd bench/results/homes-few-moves
    python slow_requests.py c-seeds-4-8 project,vllm_router_sticky_least_loaded 4,5,6,7,8
"""

from __future__ import annotations

import bisect
import json
import sys
from collections.abc import Callable
from pathlib import Path

WARM_UP_S = 16.0
SLOW_S = 0.3


def slow_requests(run: Path, policy: str, seed: int) -> list[str]:
    lines = (run / "traces" / f"c-seed{seed}.jsonl").read_text().splitlines()[1:]
    groups = [json.loads(line)["prefix_group"] for line in lines]
    results = json.loads((run / "traces" / f"c-seed{seed}-{policy}-results.json").read_text())
    spilling = _spilling(run / "traces" / f"c-seed{seed}-{policy}-queues.json")
    started = results["started_at_unix"]
    served = sorted(
        (r["scheduled_at_s"], groups[r["index"]], r["backend_id"], r["ttft_s"] or 0.0)
        for r in results["results"]
    )
    home: dict[int, str] = {}
    slow = []
    for i, (at, group, pod, ttft) in enumerate(served):
        kind = "queued"
        if group not in home:
            kind = "first"
        elif home[group] != pod:
            following = [p for _, g, p, _ in served[i + 1 :] if g == group][:1]
            kind = "spill" if following in ([], [home[group]]) else "move"
            if spilling(home[group], started + at):
                kind = "spill"
        if kind != "spill":
            home[group] = pod
        if at >= WARM_UP_S and ttft > SLOW_S:
            slow.append(f"{kind}@{at:.0f}s:{ttft:.2f}")
    return slow


def _spilling(path: Path) -> Callable[[str, float], bool]:
    """Whether a pod spilled in the server's decision at a Unix time (never, without the
    decisions)."""
    if not path.exists():
        return lambda pod, at: False
    changes = json.loads(path.read_text())["decisions"]
    times = [t for t, _ in changes]

    def spilling(pod: str, at: float) -> bool:
        i = bisect.bisect_right(times, at) - 1
        return i >= 0 and bool(changes[i][1].get(pod, (0, False))[1])

    return spilling


def main() -> None:
    run = Path(sys.argv[1])
    for policy in sys.argv[2].split(","):
        for seed in (int(s) for s in sys.argv[3].split(",")):
            slow = slow_requests(run, policy, seed)
            print(f"{policy} seed {seed}: {len(slow)} slow: {' '.join(slow)}")


if __name__ == "__main__":
    main()
