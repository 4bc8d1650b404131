"""`python -m bench.record_decisions`: record the policy's decisions on benchmark scenarios.

    python -m bench.record_decisions [--scenarios a,b,c,d,e,f,h] [--duration 6]
        [--per-scenario 150] [--out tests/policy/data/decisions.json.gz]

Runs each scenario once with the project's policy only (seed 1) and keeps, of every call
of the policy (`Decider.steps`), the inputs, the memory and the result, at most
`--per-scenario` of them per scenario spread evenly over the run (bench/decision_records.py).
The replay test decides them again after a change of the policy's code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

from bench.decision_records import Recording, encode, save
from bench.runner import RunOptions, run_benchmark
from bench.scenarios import build_scenario
from xds_server.policy.decision import Decider, Decision, DecisionInputs, PolicyMemory

DEFAULT_OUT = Path("tests/policy/data/decisions.json.gz")


def _recording_steps(
    calls: list[tuple[DecisionInputs, PolicyMemory, Decision, PolicyMemory]],
) -> Any:
    original = Decider.steps

    def steps(
        self: Decider, inputs: DecisionInputs, memory: PolicyMemory
    ) -> Generator[None, None, tuple[Decision, PolicyMemory]]:
        result = yield from original(self, inputs, memory)
        calls.append((inputs, memory, *result))
        return result

    return steps


def _evenly(items: list[Any], count: int) -> list[Any]:
    if len(items) <= count:
        return items
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def record(scenarios: list[str], *, duration_s: float, per_scenario: int) -> Recording:
    recording = Recording()
    original = Decider.steps
    try:
        for name in scenarios:
            calls: list[tuple[DecisionInputs, PolicyMemory, Decision, PolicyMemory]] = []
            Decider.steps = _recording_steps(calls)  # type: ignore[method-assign]
            build_scenario(name, duration_s=duration_s)
            with tempfile.TemporaryDirectory() as out:
                options = RunOptions(
                    scenarios=[name],
                    seeds=(1,),
                    duration_s=duration_s,
                    out_dir=Path(out),
                    reaction_trials=2,
                    policies=["project"],
                )
                asyncio.run(run_benchmark(options))
            for inputs, memory, decision, next_memory in _evenly(calls, per_scenario):
                recording.decisions.append(
                    {
                        "scenario": name,
                        "config": recording.config_index(inputs.config),
                        "inputs": {"signals": encode(inputs.signals), "load": encode(inputs.load)},
                        "memory": encode(memory),
                        "decision": encode(decision),
                        "next_memory": encode(next_memory),
                    }
                )
            print(f"scenario {name}: {len(calls)} decisions, kept {min(len(calls), per_scenario)}")
    finally:
        Decider.steps = original  # type: ignore[method-assign]
    return recording


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.record_decisions")
    parser.add_argument("--scenarios", default="a,b,c,d,e,f,h")
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--per-scenario", type=int, default=150)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    recording = record(scenarios, duration_s=args.duration, per_scenario=args.per_scenario)
    save(recording, args.out)
    print(f"{len(recording.decisions)} decisions, {len(recording.configs)} configs -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
