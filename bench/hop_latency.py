"""The cost of one proxy hop at idle: Envoy driven by this server, and vllm-router.

A per-request router is a proxy hop like Envoy, and its own cost is part of any
comparison with it (issue 18, item 6). One fast simulated pod is reached three ways by the
same client with the same request, a short streamed chat:

  direct                   the pod's own URL
  envoy_project            a real Envoy configured by this server (`run_local_gateway`),
                           the project's policy at its defaults (GPU-aware least request)
  vllm_router_<policy>     `vllm-router --policy <policy>` (bench/peers.py); every peer
                           policy but `power_of_two`, which refuses a single worker
                           ("requires at least 2 workers")

Requests are sequential, so nothing queues, and sent in rounds of one request per path in
a shuffled order, so that whatever else the machine does hits every path alike. A path's
added latency is its time minus the direct request's of the same round, per round; the
median and P99 (nearest rank) of those differences are reported, for the first token
(the first SSE `data:` line) and for the whole response. The client is aiohttp, as the
load generator's, with one keep-alive connection per path: the figure is the hop, not a
TCP handshake.

    python -m bench hop-latency [--requests 200] [--peers vllm_router_cache_aware,...]
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.peers import PEER_POLICIES, peer_versions, run_vllm_router
from bench.scenarios import MODEL
from llm_sim.loadgen.stats import percentile
from llm_sim.pod import SimulatedPod
from llm_sim.profiles import H100
from xds_server.config import RoutingConfig
from xds_testbed.envoy_process import find_envoy
from xds_testbed.gateway import run_local_gateway

__all__ = ["DIRECT", "ENVOY", "HOP_PEERS", "markdown_line", "measure_hop_latency"]

DIRECT = "direct"
ENVOY = "envoy_project"
# The peer policies that run in front of one pod: vllm-router's (SGLang's router is not
# measured here).
HOP_PEERS = tuple(
    p for p in PEER_POLICIES if p.startswith("vllm_router_") and p != "vllm_router_power_of_two"
)
# An H100 fifty times faster: a 0.6 ms step, so the pod adds little beside the hop.
_POD_PROFILE = H100.scaled(0.02)
_REQUEST = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say hello in a few words."}],
    "max_tokens": 8,
    "stream": True,
}
_READY_TIMEOUT_S = 20.0
_REQUEST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _Sample:
    first_token_s: float
    total_s: float


async def _send(session: aiohttp.ClientSession, url: str) -> _Sample:
    """One streamed chat; raises RuntimeError on anything but a 200 with a token."""
    started = time.perf_counter()
    first: float | None = None
    async with session.post(f"{url}/v1/chat/completions", json=_REQUEST) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
        async for line in response.content:
            if first is None and line.startswith(b"data: ") and b"[DONE]" not in line:
                first = time.perf_counter()
    total = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url} streamed no token.")
    return _Sample(first_token_s=first - started, total_s=total - started)


async def _until_answers(session: aiohttp.ClientSession, url: str) -> None:
    """Retry until the path serves a chat (Envoy may not hold the endpoint yet)."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while True:
        try:
            await _send(session, url)
            return
        except (RuntimeError, aiohttp.ClientError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def _config(pod: SimulatedPod) -> RoutingConfig:
    return RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "pools": [
                {
                    "name": "llm",
                    "models": [MODEL],
                    "balancing": "least_request",
                    "gpu_aware": True,
                    "endpoints": [{"address": pod.host, "port": pod.port, "weight": 1}],
                }
            ],
        }
    )


def _envoy_version() -> str:
    done = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, check=True)
    return done.stdout.strip().rsplit("version: ", 1)[-1]


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def _figures(samples: Mapping[str, Sequence[_Sample]]) -> dict[str, Any]:
    """Each path's own latencies and, beside the direct path, its added latency per round."""
    direct = samples[DIRECT]
    paths: dict[str, Any] = {}
    for path, taken in samples.items():
        figures: dict[str, Any] = {
            "first_token_s": _spread([s.first_token_s for s in taken]),
            "total_s": _spread([s.total_s for s in taken]),
        }
        if path != DIRECT:
            pairs = list(zip(taken, direct, strict=True))
            figures["added_first_token_s"] = _spread(
                [s.first_token_s - d.first_token_s for s, d in pairs]
            )
            figures["added_total_s"] = _spread([s.total_s - d.total_s for s, d in pairs])
        paths[path] = figures
    return paths


async def measure_hop_latency(
    *, requests: int, peers: Sequence[str], warmup: int = 10, seed: int = 1
) -> dict[str, Any]:
    """`requests` measured rounds (after `warmup` unmeasured ones) over the direct path,
    Envoy with this server, and each of `peers` (of HOP_PEERS); returns the figures."""
    unknown = sorted(set(peers) - set(HOP_PEERS))
    if unknown or requests < 1:
        raise ValueError(f"Need requests >= 1 and peers from {HOP_PEERS}, not {unknown}.")
    async with contextlib.AsyncExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hop-latency-")))
        pod = await stack.enter_async_context(
            SimulatedPod("hop-0", profile=_POD_PROFILE, model=MODEL)
        )
        config_path = workdir / "config.json"
        config_path.write_text(_config(pod).model_dump_json())
        gateway = await stack.enter_async_context(
            run_local_gateway(config_path, node_id="hop-envoy", config_poll_s=3600)
        )
        urls = {DIRECT: pod.url, ENVOY: gateway.url}
        commands = {}
        for peer in peers:
            running = await stack.enter_async_context(
                run_vllm_router(
                    PEER_POLICIES[peer], workers=[pod.url], log_path=workdir / f"{peer}.log"
                )
            )
            urls[peer] = running.url
            commands[peer] = " ".join(["vllm-router", *running.argv[1:]])
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S))
        )
        for url in urls.values():
            await _until_answers(session, url)
        samples: dict[str, list[_Sample]] = {path: [] for path in urls}
        order = list(urls)
        shuffle = random.Random(seed).shuffle
        for round_ in range(warmup + requests):
            shuffle(order)
            for path in order:
                sample = await _send(session, urls[path])
                if round_ >= warmup:
                    samples[path].append(sample)
    return {
        "requests_per_path": requests,
        "warmup_per_path": warmup,
        "request": _REQUEST,
        "pod": {"profile": _POD_PROFILE.name, "step_base_s": _POD_PROFILE.step_base_s},
        "versions": {"envoy": _envoy_version(), **peer_versions(peers)},
        "peer_commands": commands,
        "paths": _figures(samples),
    }


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.2f}"


def markdown_line(results: Mapping[str, Any]) -> str:
    """One sentence: each hop's added latency, median / P99, beside the direct figures."""
    paths = results["paths"]
    direct = paths[DIRECT]
    hops = "; ".join(
        f"{path} {_ms(f['added_first_token_s']['p50'])} / {_ms(f['added_first_token_s']['p99'])}"
        f" ms ({_ms(f['added_total_s']['p50'])} / {_ms(f['added_total_s']['p99'])} ms)"
        for path, f in paths.items()
        if path != DIRECT
    )
    return (
        f"One proxy hop at idle ({results['requests_per_path']} sequential streamed chats per"
        " path, interleaved rounds): added latency to the first token, median / P99 of the"
        " per-round difference to the direct request (whole response in brackets):"
        f" {hops}. Direct: first token {_ms(direct['first_token_s']['p50'])} /"
        f" {_ms(direct['first_token_s']['p99'])} ms, whole response"
        f" {_ms(direct['total_s']['p50'])} / {_ms(direct['total_s']['p99'])} ms."
    )
