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

What the router sees of the pods (measured against 0.1.17): at start it asks each worker
`GET /health` only; later `GET /get_load` (404 on the simulator: load -1) and, for
`cache_aware`, `POST /v1/chat/completions/render` and `POST /tokenize` (404: it logs
"Prefix input preparation unavailable ... render_unavailable"). With `--worker-urls` and
without `--enable-igw` every worker is registered under model "unknown" whatever its
`/v1/models` says: the model id is a worker label that only service discovery or the IGW
`/add_worker` API sets, and in this mode one prefix tree ('default') holds every worker.

Session keys: `consistent_hash` and `sticky_least_loaded` take the first of the headers
`x-session-id`, `x-user-id`, ... then the body's `session_params.session_id`, `user`,
`session_id`, `user_id`. The load generator already sends `x-session-id` and `user` for a
trace's sessions and `user` for its users; a request with neither (the shared-prefix
groups of c carry only `prompt_cache_key`, which the router does not read) is hashed on
its whole body by `consistent_hash` and has no session for `sticky_least_loaded`.

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
    policy: str, *, workers: Sequence[str], log_path: Path
) -> AsyncIterator[RunningPeer]:
    """`vllm-router --policy <policy>` in front of `workers` (base URLs), on free loopback
    ports, its output in `log_path`; yields once every worker is healthy in it, and stops
    the process (by its PID) on exit."""
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
        "warning",
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
