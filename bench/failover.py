"""Scenario i: two clusters, a failure and a recovery of cluster A's pods.

Cluster A and cluster B each have two simulated H100-like pods (a batch of 8). Streamed
chat requests arrive at A's gateway (Poisson, `--rate` per second, the same seeded arrival
times for every policy); at `kill_s` every pod of A dies (its port refuses, its open
streams are cut), at `revive_s` they come back with fresh engines. Three ways to route:

    project           A's pool with B's gateway as a remote (docs/global.md): B's server
                      peered, failover on A's server's view, the ramp back
    round_robin_both  one pool over A's and B's pods, round robin (a Service spanning both
                      clusters): Envoy's retries and outlier detection alone
    local_only        A's pool alone, GPU-aware: what a cluster without failover does

Figures per policy (results.json `policies.<name>`):

    failed_requests   requests not served whole: an error status, or a stream cut
                      (those on A's pods at the kill are cut whatever the policy)
    failed_before_headers   requests answered with an error status (the part routing
                      can save)
    failover_s        from the kill to the first request after which every request sent
                      until the revival succeeded (null: never)
    ttft_p99_s        TTFT P99 of the requests sent between the kill and the revival that
                      succeeded (with `failover_window_requests` and their failures)
    ramp_up_s         from the revival until A's pods serve, over one second, at least 90%
                      of the share they had before the kill (null: not within the run)
    ramp_max_pod_requests   the most requests (running and waiting) on one of A's pods
                      from the revival until `ramp_up_s`: at most the batch is no
                      overload (`steady_max_pod_requests`: the same, in the 5 s
                      before the kill)
    a_share_per_second      A's share of the requests of each second after the revival

    flock /tmp/bench.lock python -m bench.failover --out bench/results/i
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.profiles import H100
from xds_server.config import RoutingConfig
from xds_testbed.gateway import LocalGateway, run_local_gateway
from xds_testbed.server_process import free_port

__all__ = ["Outcome", "POLICIES", "Timeline", "figures", "markdown", "run_scenario_i"]

POLICIES = ("project", "round_robin_both", "local_only")
BATCH = 8
PROFILE = dataclasses.replace(H100, max_num_seqs=BATCH)
BACKEND_HEADER = "x-backend-id"


@dataclass(frozen=True, kw_only=True)
class Timeline:
    duration_s: float = 45.0
    kill_s: float = 12.0
    revive_s: float = 27.0
    rate_per_s: float = 8.0
    max_tokens: int = 24
    seed: int = 1

    def arrivals(self) -> list[float]:
        rng = random.Random(self.seed)
        times: list[float] = []
        t = 0.0
        while True:
            t += rng.expovariate(self.rate_per_s)
            if t >= self.duration_s:
                return times
            times.append(t)


@dataclass
class Outcome:
    """One request: when it was sent (s from the run's start), by whom it was served, its
    status, whether the stream ended whole, and its TTFT."""

    sent_s: float
    pod: str | None = None
    status: int = 0
    whole: bool = False
    ttft_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.whole


@dataclass
class _Samples:
    # (s from start, most requests on one of A's pods)
    peaks: list[tuple[float, int]] = field(default_factory=list)


def figures(
    outcomes: Sequence[Outcome], peaks: Sequence[tuple[float, int]], timeline: Timeline
) -> dict[str, Any]:
    """The module docstring's figures from one policy's outcomes (pure)."""
    kill, revive = timeline.kill_s, timeline.revive_s
    done = sorted(outcomes, key=lambda o: o.sent_s)
    window = [o for o in done if kill <= o.sent_s < revive]
    failover_s: float | None = None
    for index, outcome in enumerate(window):
        if all(o.ok for o in window[index:]):
            failover_s = round(outcome.sent_s - kill, 3)
            break
    ttfts = sorted(o.ttft_s for o in window if o.ok and o.ttft_s is not None)
    before = [o for o in done if kill - 5 <= o.sent_s < kill and o.ok]
    baseline = _share_of_a(before)
    per_second = []
    ramp_up_s: float | None = None
    for second in range(int(timeline.duration_s - revive)):
        bucket = [o for o in done if revive + second <= o.sent_s < revive + second + 1 and o.ok]
        share = _share_of_a(bucket)
        per_second.append(round(share, 3) if share is not None else None)
        if ramp_up_s is None and share is not None and baseline and share >= 0.9 * baseline:
            ramp_up_s = float(second + 1)
    return {
        "requests": len(done),
        "failed_requests": sum(1 for o in done if not o.ok),
        "failed_before_headers": sum(1 for o in done if o.status != 200),
        "failover_s": failover_s,
        "failover_window_requests": len(window),
        "failover_window_failed": sum(1 for o in window if not o.ok),
        "ttft_p99_s": round(_quantile(ttfts, 0.99), 4) if ttfts else None,
        "ttft_p50_s": round(_quantile(ttfts, 0.5), 4) if ttfts else None,
        "a_share_before": round(baseline, 3) if baseline is not None else None,
        "ramp_up_s": ramp_up_s,
        "ramp_max_pod_requests": max(
            (n for t, n in peaks if revive <= t <= revive + (ramp_up_s or math.inf)),
            default=None,
        ),
        "steady_max_pod_requests": max(
            (n for t, n in peaks if kill - 5 <= t < kill), default=None
        ),
        "a_share_per_second": per_second,
    }


def _share_of_a(outcomes: Sequence[Outcome]) -> float | None:
    if not outcomes:
        return None
    return sum(1 for o in outcomes if (o.pod or "").startswith("a-")) / len(outcomes)


def _quantile(values: Sequence[float], q: float) -> float:
    index = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
    return values[index]


def _config(
    *, listener_port: int, pods: Sequence[tuple[str, int]], **pool: Any
) -> RoutingConfig:
    return RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": listener_port},
            "updates": {"debounce_s": 0.02},
            "balancing": {"scrape_interval_s": 0.1, "stale_after_s": 0.6},
            "pools": [
                {
                    "name": "gpu",
                    "models": ["m"],
                    "batch_limit": BATCH,
                    "endpoints": [{"address": a, "port": p} for a, p in pods],
                    **pool,
                }
            ],
        }
    )


@contextlib.asynccontextmanager
async def _gateways(
    policy: str, a: Fleet, b: Fleet, tmp: Path
) -> AsyncIterator[LocalGateway]:
    """Cluster A's gateway for `policy` (and B's, for the project)."""
    local = [("127.0.0.1", p.port) for p in a]
    remote = [("127.0.0.1", p.port) for p in b]
    async with contextlib.AsyncExitStack() as stack:
        if policy == "project":
            b_port = free_port()
            b_path = tmp / "b.json"
            b_path.write_text(_config(listener_port=b_port, pods=remote).model_dump_json())
            gateway_b = await stack.enter_async_context(
                run_local_gateway(b_path, node_id="envoy-b", config_poll_s=3600)
            )
            pool: dict[str, Any] = {
                "remotes": [
                    {
                        "name": "b",
                        "address": "127.0.0.1",
                        "port": b_port,
                        "peer": f"127.0.0.1:{gateway_b.app.xds_port}",
                    }
                ]
            }
            config = _config(listener_port=free_port(), pods=local, **pool)
        elif policy == "round_robin_both":
            config = _config(
                listener_port=free_port(), pods=local + remote, balancing="round_robin"
            )
        else:
            config = _config(listener_port=free_port(), pods=local)
        path = tmp / f"a-{policy}.json"
        path.write_text(config.model_dump_json())
        gateway_a = await stack.enter_async_context(
            run_local_gateway(path, node_id="envoy-a", config_poll_s=3600)
        )
        yield gateway_a


async def _one(
    http: aiohttp.ClientSession, url: str, outcome: Outcome, started: float, max_tokens: int
) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    loop = asyncio.get_running_loop()
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            outcome.status = response.status
            outcome.pod = response.headers.get(BACKEND_HEADER)
            async for line in response.content:
                if line.startswith(b"data:") and outcome.ttft_s is None:
                    outcome.ttft_s = loop.time() - started - outcome.sent_s
                if line.strip() == b"data: [DONE]":
                    outcome.whole = True
    except (TimeoutError, aiohttp.ClientError):
        pass


async def _run_policy(policy: str, timeline: Timeline, tmp: Path) -> dict[str, Any]:
    specs_a = [PodSpec(name=f"a-{i}", profile=PROFILE) for i in range(2)]
    specs_b = [PodSpec(name=f"b-{i}", profile=PROFILE) for i in range(2)]
    async with (
        Fleet(specs_a, model="m", seed=timeline.seed) as a,
        Fleet(specs_b, model="m", seed=timeline.seed + 10) as b,
        _gateways(policy, a, b, tmp) as gateway,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
    ):
        loop = asyncio.get_running_loop()
        started = loop.time()
        samples = _Samples()
        outcomes: list[Outcome] = []
        tasks: list[asyncio.Task[None]] = []

        async def faults() -> None:
            await asyncio.sleep(max(0.0, started + timeline.kill_s - loop.time()))
            for pod in a:
                await pod.kill()
            await asyncio.sleep(max(0.0, started + timeline.revive_s - loop.time()))
            for pod in a:
                await pod.revive()

        async def watch() -> None:
            while True:
                most = 0
                for pod in a:
                    if pod.state.value == "open":
                        engine = pod.state_snapshot().engine
                        most = max(most, engine.num_running + engine.num_waiting)
                samples.peaks.append((loop.time() - started, most))
                await asyncio.sleep(0.05)

        injector = asyncio.create_task(faults())
        watcher = asyncio.create_task(watch())
        for at in timeline.arrivals():
            await asyncio.sleep(max(0.0, started + at - loop.time()))
            outcome = Outcome(sent_s=at)
            outcomes.append(outcome)
            tasks.append(
                asyncio.create_task(
                    _one(http, gateway.url, outcome, started, timeline.max_tokens)
                )
            )
        await asyncio.gather(*tasks)
        await injector
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return figures(outcomes, samples.peaks, timeline)


async def run_scenario_i(
    timeline: Timeline, policies: Sequence[str], tmp: Path
) -> dict[str, Any]:
    """Every policy in turn, each on fresh pods and gateways."""
    results: dict[str, Any] = {
        "scenario": "i",
        "title": "two clusters: every pod of A killed, then revived",
        "timeline": dataclasses.asdict(timeline),
        "batch": BATCH,
        "policies": {},
    }
    for policy in policies:
        started = time.monotonic()
        results["policies"][policy] = await _run_policy(policy, timeline, tmp)
        print(f"{policy}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return results


def markdown(results: dict[str, Any]) -> str:
    keys = (
        "failover_s", "failed_requests", "failed_before_headers", "ttft_p99_s",
        "ramp_up_s", "ramp_max_pod_requests", "steady_max_pod_requests", "requests",
    )  # fmt: skip
    lines = [
        f"Scenario i: {results['title']} (batch {results['batch']}; {results['timeline']})",
        "",
        "| policy | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for policy, figures_ in results["policies"].items():
        lines.append(f"| {policy} | " + " | ".join(str(figures_[k]) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results/i"))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=Timeline.rate_per_s)
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if set(policies) - set(POLICIES):
        print(f"policies are {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    timeline = Timeline(seed=args.seed, rate_per_s=args.rate)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(run_scenario_i(timeline, policies, Path(tmp)))
    (args.out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    table = markdown(results)
    (args.out / "results.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
