"""Peers: real per-request routers run as benchmark policies, beside Envoy.

A peer policy starts the router as its own process in front of the same simulated pods
and the same trace is replayed against its URL instead of Envoy's. Today the one peer is
`vllm-router` (the PyPI package pinned in the `bench` extra), started as a user would:

    vllm-router --host 127.0.0.1 --port <free> --prometheus-host 127.0.0.1
        --prometheus-port <free> --worker-urls http://127.0.0.1:<pod> ... --policy <policy>
        --log-level warning

Only the documented flags above are set; every other one keeps its default (retries,
circuit breaker, `--queue-size 100`, `--max-concurrent-requests 32768`,
`--cache-threshold 0.3`, `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`).
`--prometheus-port` is set only because its default (29000) is fixed and it refuses 0.
Not set, on purpose: `--enable-igw` (below), `--service-discovery` (Kubernetes only),
`--kv-event-source` (`kv_aware`, below).

What the router asks a worker (measured against 0.1.17) and what a simulated pod answers,
as vLLM does:
- `GET /health` at start: 200.
- `cache_aware`, per request and per worker: `POST /v1/chat/completions/render` (or
  `/v1/completions/render`), then `POST /tokenize` if render fails. The pods answer both as
  vLLM does (`GenerateRequest` with `token_ids`; `count`/`max_model_len`/`tokens`), with
  the simulator's own tokens as ids, so the router's prefix tree holds the tokens the pods'
  prefix caches hold. Without them (404 before) it logged "Prefix input preparation
  unavailable ... render_unavailable" and made no prefix decision at all.
- `power_of_two`, every 5 s: `GET /get_load`, parsed as `{"load": <int>}`. That is SGLang's
  endpoint; vLLM has none (its `/load`, behind `--enable-server-load-tracking`, answers
  `{"server_load": n}` and the router does not ask for it), so the pods answer 404 as a
  real vLLM worker does, and the router's own `/get_loads` lists load -1 for each of them
  (measured; 3 when a worker answers `{"load": 3}`), as it would in front of vLLM.
- Model: with `--worker-urls` every worker is registered under model "unknown" and one
  prefix tree ('default') holds them all. Only IGW mode (`--enable-igw`, then
  `POST /add_worker?url=...` per worker) discovers the model: it reads `/v1/models`, which
  the pods answer as vLLM does (measured: the worker is then registered under
  "meta-llama/Llama-3.1-8B-Instruct"). Not used: every pod of a fleet serves the same base
  model and the same adapters, so a model id splits nothing (one tree either way), and the
  router keeps one model id per worker, so it cannot route on LoRA adapters a worker
  serves several of; IGW is the multi-model mode, not what a single-model user runs.

Session keys: `consistent_hash` and `sticky_least_loaded` take the first of the headers
`x-session-id`, `x-user-id`, ... then the body's `session_params.session_id`, `user`,
`session_id`, `user_id`. The load generator sends `x-session-id` and `user` for a trace's
sessions and `user` for its users. The shared-prefix groups of c carry only the body's
`prompt_cache_key`, which the router does not read; as its user would, every peer replay
also sends that key as `x-session-id` when a request has no session of its own
(`PEER_SESSION_HEADER`, recorded as `peer.session_header` in results.json; the trace and
the bodies are the same as for every other policy). `cache_aware` gets the header too (a
user sends it whatever the policy). Without it, `cache_aware` routes on the rendered tokens
(tests/bench/test_peers_smoke.py); how much the header adds to that on c was not isolated.

`kv_aware` is not offered: it routes on KV events published by vLLM over ZMQ
(`--kv-event-source WORKER_URL=ENDPOINT`), which the simulator does not emit.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from xds_testbed.server_process import free_port

__all__ = [
    "PEER_POLICIES",
    "PEER_SESSION_HEADER",
    "PeerStartError",
    "RunningPeer",
    "peer_versions",
    "run_vllm_router",
]

logger = logging.getLogger(__name__)

# Benchmark policy name -> vllm-router `--policy`.
PEER_POLICIES = {
    "vllm_router_cache_aware": "cache_aware",
    "vllm_router_consistent_hash": "consistent_hash",
    "vllm_router_power_of_two": "power_of_two",
    "vllm_router_sticky_least_loaded": "sticky_least_loaded",
}
# How the replay gives every peer the trace's prefix groups as session keys (results.json).
PEER_SESSION_HEADER = "x-session-id: prompt_cache_key, when the request has no session"
_PACKAGE = "vllm-router"
_READY_TIMEOUT_S = 30.0
_POLL_S = 0.1


class PeerStartError(RuntimeError):
    """The router exited or did not list every worker as healthy in time."""


@dataclass(frozen=True)
class RunningPeer:
    """A started router: where to send the trace, and the exact command it runs."""

    url: str
    argv: tuple[str, ...]


def peer_versions() -> dict[str, str]:
    """The installed version of every peer package (for results.json)."""
    return {_PACKAGE: importlib.metadata.version(_PACKAGE)}


def _executable() -> str:
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise PeerStartError("vllm-router is not installed: pip install -e '.[bench]'.")
    return found


async def _ready(url: str, workers: Sequence[str], process: asyncio.subprocess.Process) -> None:
    """Poll `/workers` until every worker is listed healthy; raise if the router exits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _READY_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while loop.time() < deadline:
            if process.returncode is not None:
                raise PeerStartError(f"vllm-router exited with status {process.returncode}.")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}/workers") as response:
                    if response.status == 200:
                        listed = (await response.json()).get("workers", [])
                        healthy = {w["url"] for w in listed if w.get("is_healthy")}
                        if healthy >= set(workers):
                            return
            await asyncio.sleep(_POLL_S)
    raise PeerStartError(f"vllm-router at {url} did not list {len(workers)} healthy workers.")


@contextlib.asynccontextmanager
async def run_vllm_router(
    policy: str, *, workers: Sequence[str], log_path: Path, log_level: str = "warning"
) -> AsyncIterator[RunningPeer]:
    """`vllm-router --policy <policy>` in front of `workers` (base URLs), on free loopback
    ports, its output (at `log_level`) in `log_path`; yields once every worker is healthy in
    it, and stops the process (by its PID) on exit."""
    port, metrics_port = free_port(), free_port()
    argv = (
        _executable(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--log-level",
        log_level,
    )
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=log)
    try:
        await _ready(url, workers, process)
        logger.info("vllm-router (%s) ready at %s for %d workers.", policy, url, len(workers))
        yield RunningPeer(url=url, argv=argv)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 5)
            except TimeoutError:
                process.kill()
                await process.wait()
