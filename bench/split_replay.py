"""One trace sent through several Envoys in fixed shares (scenario f2): the load generator.

Scenario f2 sends f's trace through two Envoys, 70% of its requests to one and 30% to the
other. Which request goes where is drawn once per request from an RNG seeded by the
trace's seed (`split_trace`), so every run of a trace splits it the same way, and each
band is split in about the same shares.

Each part is replayed by `llm_sim.loadgen.replay` against its own URL, all parts at once
on one event loop in one process (`python -m bench.split_replay`, started by
`run_split_replay_in_subprocess`): one generator process as in every other scenario,
rather than one per Envoy competing for the same two cores. The parts' results are merged
back into one `ReplayResult` in trace order (`merge_results`); requests keep their index in
the whole trace, and `scheduled_at_s` is the trace's own offset, so the figures of f apply
unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import logging
import random
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from llm_sim.loadgen import ReplayResult
from llm_sim.loadgen.errors import LoadgenError, ReplayFailedError
from llm_sim.loadgen.replay import replay
from llm_sim.loadgen.trace import Trace

__all__ = [
    "main",
    "merge_results",
    "part_of_each_request",
    "replay_split",
    "run_split_replay_in_subprocess",
    "split_trace",
]

logger = logging.getLogger(__name__)


def part_of_each_request(trace: Trace, *, shares: Sequence[float]) -> list[int]:
    """For each request of `trace`, in order, the index of the part (of `shares`, which sum
    to 1) it goes to: one draw per request from an RNG seeded by the trace's seed."""
    if not shares or any(s < 0 for s in shares) or abs(sum(shares) - 1) > 1e-9:
        raise ValueError(f"shares must be non-negative and sum to 1, got {list(shares)}")
    rng = random.Random(f"split-replay-{trace.seed}")
    bounds = list(itertools.accumulate(shares))
    parts = []
    for _ in trace.requests:
        draw = rng.random()
        parts.append(next((i for i, bound in enumerate(bounds) if draw < bound), len(shares) - 1))
    return parts


def split_trace(trace: Trace, *, shares: Sequence[float]) -> list[Trace]:
    """`trace` cut into one trace per share (`part_of_each_request`); each request keeps
    its index and offset in the whole trace."""
    parts = part_of_each_request(trace, shares=shares)
    return [
        dataclasses.replace(
            trace, requests=tuple(r for r, p in zip(trace.requests, parts, strict=True) if p == i)
        )
        for i in range(len(shares))
    ]


def merge_results(parts: Sequence[ReplayResult], *, url: str) -> ReplayResult:
    """The parts' results as one replay's: requests in trace order, the generator's health
    as its worst part's (the lag probes share one event loop), the start as the first
    part's (they start within a millisecond of each other on that loop)."""
    if not parts:
        raise ValueError("no results to merge")
    first = parts[0]
    return dataclasses.replace(
        first,
        url=url,
        results=tuple(sorted((r for p in parts for r in p.results), key=lambda r: r.index)),
        started_at_unix=min(p.started_at_unix for p in parts),
        duration_s=max(p.duration_s for p in parts),
        loop_lag_p50_s=max(p.loop_lag_p50_s for p in parts),
        loop_lag_p99_s=max(p.loop_lag_p99_s for p in parts),
        loop_lag_max_s=max(p.loop_lag_max_s for p in parts),
        send_lateness_p99_s=max(p.send_lateness_p99_s for p in parts),
        saturated=any(p.saturated for p in parts),
        cpu_s=first.cpu_s,  # process time: every part's replay ran in this one process
        metadata={**first.metadata, "urls": [p.url for p in parts]},
    )


async def replay_split(
    trace: Trace,
    *,
    urls: Sequence[str],
    shares: Sequence[float],
    timeout_s: float,
    max_in_flight: int,
) -> ReplayResult:
    """Replay `trace` split over `urls` in `shares` (one URL per share), every part at
    once, and merge the results; `max_in_flight` caps each part."""
    if len(urls) != len(shares):
        raise ValueError(f"one URL per share: {list(urls)} and {list(shares)}")
    parts = split_trace(trace, shares=shares)
    results = await asyncio.gather(
        *(
            replay(part, url=url, timeout_s=timeout_s, max_in_flight=max_in_flight)
            for part, url in zip(parts, urls, strict=True)
        )
    )
    return merge_results(results, url=" ".join(urls))


async def run_split_replay_in_subprocess(
    trace_path: Path,
    *,
    urls: Sequence[str],
    shares: Sequence[float],
    timeout_s: float,
    max_in_flight: int,
    wait_timeout_s: float,
) -> ReplayResult:
    """`replay_split` in a child `python -m bench.split_replay`, as the benchmark runs
    every load generator (llm_sim/loadgen/process.py says why). The child is killed when
    it runs longer than `wait_timeout_s` or this coroutine is cancelled; raises
    ReplayFailedError when it fails, with its stderr's end."""
    with tempfile.TemporaryDirectory(prefix="split-replay-") as scratch:
        output = Path(scratch) / "results.json"
        argv = [
            sys.executable, "-m", "bench.split_replay", str(trace_path),
            *(arg for url, share in zip(urls, shares, strict=True)
              for arg in ("--target", f"{share!r}={url}")),
            "--timeout-s", repr(timeout_s), "--max-in-flight", str(max_in_flight),
            "--output", str(output),
        ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        logger.info("Started the split load generator, pid %d, on %s.", process.pid, trace_path)
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), wait_timeout_s)
        except TimeoutError as exc:
            raise ReplayFailedError(
                f"The split load generator (pid {process.pid}) ran longer than"
                f" {wait_timeout_s:.0f} s and was killed."
            ) from exc
        finally:
            if process.returncode is None:
                process.kill()
                await asyncio.shield(process.wait())
        if process.returncode != 0:
            tail = stderr.decode(errors="replace")[-2000:]
            raise ReplayFailedError(
                f"The split load generator exited with status {process.returncode}: {tail}"
            )
        return ReplayResult.load(output)


def _target(text: str) -> tuple[float, str]:
    share, sep, url = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not SHARE=URL")
    try:
        return float(share), url
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the share is not a number") from exc


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: replay the trace split over the targets, write the merged results JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.split_replay", description=__doc__.splitlines()[0]
    )
    parser.add_argument("trace", type=Path, help="trace file (JSON lines, from Trace.save)")
    parser.add_argument(
        "--target",
        type=_target,
        action="append",
        required=True,
        metavar="SHARE=URL",
        help="a share of the requests and the base URL they go to (repeat; shares sum to 1)",
    )
    parser.add_argument("--timeout-s", type=float, required=True, help="per-request timeout")
    parser.add_argument("--max-in-flight", type=int, required=True, help="cap per target")
    parser.add_argument("--output", type=Path, required=True, help="results JSON file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    shares = [share for share, _ in args.target]
    urls = [url for _, url in args.target]
    try:
        result = asyncio.run(
            replay_split(
                Trace.load(args.trace),
                urls=urls,
                shares=shares,
                timeout_s=args.timeout_s,
                max_in_flight=args.max_in_flight,
            )
        )
    except (LoadgenError, ValueError) as exc:
        logger.critical("%s", exc)
        return 1
    result.save(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
