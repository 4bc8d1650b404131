"""`python -m bench run`: the routing benchmark, every policy on the same traces.

    python -m bench run [--scenarios a,b,c,d] [--variant NAME] [--seeds N | --seed-list 4,5,6]
                        [--out DIR] [--quick] [--duration S]
    python -m bench hop-latency [--requests 200] [--peers P,...] [--out DIR]

`run` writes DIR/results.json (the documented shape), DIR/results.md (the tables) and
DIR/ttft_cdf_<scenario>.png, and prints the tables. `hop-latency` measures what one proxy
hop adds at idle, Envoy's and each peer's (bench/hop_latency.py), and writes
DIR/hop_latency.json and DIR/hop_latency.md.

With `--variant NAME` every scenario runs under that variant (bench/scenarios.py
`VARIANTS`), named `<scenario>@<variant>` in the results and file names; the scenarios
default to those the variant applies to, and one it does not apply to is refused.

`--seeds N` runs seeds 1..N, `--seed-list` any seeds (results.json `seed_list`); results.md
gives, beside the medians over seeds, every latency percentile over all seeds' requests
pooled with each seed's own P95 and P99 as min-median-max (bench/pooling.py), and each
pod's share of the requests against its share of the fleet's capacity.

Some scenarios run only some policies (f: no oracle; f2: only the project, the one with
flow control for its replicas to share): the others are skipped with a message, and a
scenario left with none to run is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

from bench.hop_latency import HOP_PEERS, markdown_line, measure_hop_latency
from bench.report import markdown_table, plot_ttft_cdfs
from bench.runner import ALL_POLICIES, POLICIES, RunOptions, policies_of, run_benchmark
from bench.scenarios import SCENARIOS, VARIANTS, build_scenario, scenario_names

DEFAULT_DURATION_S = 16.0
QUICK_DURATION_S = 3.0
# A smoke run's requests are a fifth as long, so that even a collapsed policy drains in seconds.
QUICK_REQUEST_SCALE = 0.2


def _seed_list(text: str) -> list[int]:
    """`4,5,6` as seeds: distinct non-negative integers, at least one."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"seeds are integers: {text!r}") from exc
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"distinct non-negative seeds, at least one: {text!r}")
    return seeds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run scenarios x policies through a real Envoy")
    run.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated, from " + ",".join(SCENARIOS) + " (default: all, or the variant's)",
    )
    run.add_argument(
        "--variant",
        choices=sorted(VARIANTS),
        default=None,
        help="run the scenarios under this variant (bench/scenarios.py VARIANTS)",
    )
    run.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated, from " + ",".join(ALL_POLICIES) + " (default: the first four)",
    )
    seeds = run.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=int, default=1, help="run seeds (traces) 1..N")
    seeds.add_argument(
        "--seed-list",
        type=_seed_list,
        metavar="S,S,...",
        help="run these seeds (traces), e.g. 4,5,6,7,8",
    )
    run.add_argument("--out", type=Path, default=Path("bench/results"))
    run.add_argument(
        "--quick", action="store_true", help=f"{QUICK_DURATION_S:g} s of arrivals: a smoke run"
    )
    run.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run")
    run.add_argument(
        "--project-balancing",
        type=json.loads,
        default={},
        metavar="JSON",
        help="`balancing` config keys for the project policy, e.g. '{\"active_request_bias\": 0}'",
    )
    hop = commands.add_parser("hop-latency", help="the added latency of one proxy hop at idle")
    hop.add_argument("--requests", type=int, default=200, help="measured requests per path")
    hop.add_argument("--warmup", type=int, default=10, help="unmeasured requests per path")
    hop.add_argument(
        "--peers",
        default=",".join(HOP_PEERS),
        help="comma-separated, from " + ",".join(HOP_PEERS),
    )
    hop.add_argument("--out", type=Path, default=Path("bench/results/hop-latency"))
    return parser


def _hop_latency(args: argparse.Namespace) -> int:
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if set(peers) - set(HOP_PEERS) or args.requests < 1:
        print(f"--requests must be positive and --peers from {list(HOP_PEERS)}", file=sys.stderr)
        return 2
    results = asyncio.run(
        measure_hop_latency(requests=args.requests, peers=peers, warmup=args.warmup)
    )
    line = markdown_line(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hop_latency.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    (args.out / "hop_latency.md").write_text(line + "\n")
    print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "hop-latency":
        return _hop_latency(args)
    default = VARIANTS[args.variant].scenarios if args.variant else SCENARIOS
    wanted = args.scenarios.split(",") if args.scenarios is not None else default
    scenarios = [s.strip() for s in wanted if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if unknown or not scenarios or set(policies) - set(ALL_POLICIES):
        print(
            f"unknown scenarios or policies; scenarios: {SCENARIOS}, policies: {ALL_POLICIES}",
            file=sys.stderr,
        )
        return 2
    try:
        scenarios = scenario_names(scenarios, args.variant)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    seed_list = args.seed_list or list(range(1, args.seeds + 1))
    duration = args.duration or (QUICK_DURATION_S if args.quick else DEFAULT_DURATION_S)
    for name in scenarios:
        scenario = build_scenario(name, duration_s=duration)
        runs, skipped = policies_of(scenario, policies)
        if not runs:
            print(
                f"scenario {name} runs only the policies {', '.join(scenario.policies or ())};"
                f" --policies {','.join(skipped)} leaves it nothing to run",
                file=sys.stderr,
            )
            return 2
    options = RunOptions(
        scenarios=scenarios,
        seeds=seed_list,
        duration_s=duration,
        out_dir=args.out,
        request_scale=QUICK_REQUEST_SCALE if args.quick else 1.0,
        reaction_trials=5 if args.quick else 40,
        policies=policies,
        project_balancing=args.project_balancing,
    )
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    results, samples, titles = asyncio.run(run_benchmark(options, progress=progress))
    results["duration_s_per_run"] = duration
    results["seeds"] = len(seed_list)
    results["seed_list"] = seed_list
    results["variant"] = args.variant
    results["project_balancing"] = args.project_balancing
    (args.out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    table = markdown_table(results)
    (args.out / "results.md").write_text(table)
    plots = plot_ttft_cdfs(samples, titles=titles, out_dir=args.out)
    print(table)
    progress(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'} and {len(plots)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
