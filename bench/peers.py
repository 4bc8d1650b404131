"""Peers: real per-request routers run as benchmark policies, beside Envoy.

A peer policy starts the router as its own process in front of the same simulated pods
and the same trace is replayed against its URL instead of Envoy's. There are two routers,
each a PyPI package pinned in the `bench` extra and started as a user would: `vllm-router`
(`vllm_router_*`) and SGLang's router, `sglang-router` (`sglang_router_*`, below):

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

SGLang's router (`sglang_router_cache_aware`, `sglang_router_power_of_two`):

    python -m sglang_router.launch_router --host 127.0.0.1 --port <free>
        --prometheus-host 127.0.0.1 --prometheus-port <free>
        --worker-urls http://127.0.0.1:<pod> ... --policy <policy> --log-level warn

Only the documented flags above are set; every other one keeps its default
(`--cache-threshold 0.3`, `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`,
`--eviction-interval-secs 60`, `--max-tree-size 67108864`, 5 retries, circuit breaker,
health checks every 60 s, no rate limit, `--backend sglang`). `--prometheus-port` for the
same reason as vllm-router's (default 29000); `--log-level warn` because at its default
(info) it logs two lines per request. Not offered: `random` and `round_robin` (round robin
is Envoy's already), `manual` (sticky on an `X-SMG-Routing-Key` header a client must
send), `bucket` (prefill-decode mode only).

Its workers are SGLang servers, so behind it the pods are SGLang-flavoured (`peer_pods`:
the same hardware, names, adapters and engine; SGLang's endpoints and `/metrics` page,
which nothing reads during a peer's replay). What it asks a worker (measured against
0.3.2 with its log at debug, and read in its source, sgl-model-gateway) and what the pods
answer, as SGLang does (`llm_sim.sglang_api`):
- At registration, in parallel: `GET /health` (200) and a gRPC health check over
  cleartext HTTP/2 (SGLang's scheduler service, then vLLM's). The pod answers the HTTP/2
  preface with 400, as an HTTP/1 server does (aiohttp logs it as an error), and the worker
  is registered as HTTP.
- Then `GET /server_info` and `GET /model_info`, and on a 404 the deprecated
  `/get_server_info` and `/get_model_info`; the pods answer all four with SGLang's fields
  (`model_path`, `served_model_name`, `dp_size`, ...; `model_type`, `architectures`). The
  router then registers each worker under model "meta-llama/Llama-3.1-8B-Instruct" (under
  "unknown" when they are missing, as before) and tries to load that model's tokenizer
  from the Hugging Face hub; offline it logs "Failed to download tokenizer" and goes on
  (its HTTP mode needs none). Requests naming a LoRA adapter are still routed (measured).
- `power_of_two`: every 30 s from its start (its log: "Starting load monitoring with
  interval: 30s"; the startup line's `load_check_interval_secs: 5` is not what it uses),
  `GET /get_load` on every worker, the sum of `num_tokens` over the listed ranks. The pods
  answer SGLang's list (`dp_rank`, `num_reqs`, `num_waiting_reqs`, `num_tokens`: the KV
  tokens the running requests hold plus the waiting requests' whole prompts); a vLLM pod
  answers 404 and is listed with load -1. It picks the lower of two random workers' last
  polled loads, so a load is up to 30 s old; before the first poll it has none and picks
  at random (its fallback, its own per-worker request counts, read 0 with a stream in
  flight: measured, tests/bench/test_sglang_peers_smoke.py).
- `cache_aware`: nothing. It matches the request's text (a chat's message contents, a
  completion's prompt) in its own character-level prefix tree, so no tokenizer or render
  endpoint is asked.

Session keys: neither policy reads one (only `manual` does). The replay is the same as for
every peer (`PEER_SESSION_HEADER`; the trace's `user` and `prompt_cache_key` in the body), what a
user sends whatever the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import logging
import shutil
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from llm_sim.fleet import PodSpec
from llm_sim.metrics_text import Flavour
from xds_testbed.server_process import free_port

__all__ = [
    "PEER_POLICIES",
    "PEER_SESSION_HEADER",
    "PeerStartError",
    "RunningPeer",
    "peer_pods",
    "peer_versions",
    "run_peer",
    "run_sglang_router",
    "run_vllm_router",
]

logger = logging.getLogger(__name__)

# Benchmark policy name -> the router's `--policy`; the name's prefix says which router.
PEER_POLICIES = {
    "vllm_router_cache_aware": "cache_aware",
    "vllm_router_consistent_hash": "consistent_hash",
    "vllm_router_power_of_two": "power_of_two",
    "vllm_router_sticky_least_loaded": "sticky_least_loaded",
    "sglang_router_cache_aware": "cache_aware",
    "sglang_router_power_of_two": "power_of_two",
}
# How the replay gives every peer the trace's prefix groups as session keys (results.json).
PEER_SESSION_HEADER = "x-session-id: prompt_cache_key, when the request has no session"
_VLLM = "vllm-router"
_SGLANG = "sglang-router"
# The PyPI package behind each policy-name prefix, and the API its workers speak.
_PACKAGES = {"vllm_router_": _VLLM, "sglang_router_": _SGLANG}
_WORKER_FLAVOURS = {_VLLM: Flavour.VLLM, _SGLANG: Flavour.SGLANG}
_READY_TIMEOUT_S = 30.0
_POLL_S = 0.1


class PeerStartError(RuntimeError):
    """The router exited or did not list every worker as healthy in time."""


@dataclass(frozen=True)
class RunningPeer:
    """A started router: where to send the trace, the exact command it runs, and that
    command as a user types it (`command`, for results.json)."""

    url: str
    argv: tuple[str, ...]
    command: str


def _package(policy: str) -> str:
    for prefix, package in _PACKAGES.items():
        if policy.startswith(prefix) and policy in PEER_POLICIES:
            return package
    raise ValueError(f"{policy!r} is not a peer policy (one of {sorted(PEER_POLICIES)}).")


def peer_versions(policies: Iterable[str] = PEER_POLICIES) -> dict[str, str]:
    """The installed version of the package behind each peer of `policies` (others are
    ignored), for results.json."""
    packages = {_package(p) for p in policies if p in PEER_POLICIES}
    return {package: importlib.metadata.version(package) for package in sorted(packages)}


def peer_pods(policy: str, pods: Sequence[PodSpec]) -> list[PodSpec]:
    """`pods` as the workers of `policy` serve: SGLang-flavoured behind SGLang's router (the
    endpoints it asks, above), unchanged otherwise; the same hardware, adapters and names."""
    if policy not in PEER_POLICIES:
        return list(pods)
    flavour = _WORKER_FLAVOURS[_package(policy)]
    return [dataclasses.replace(pod, flavour=flavour) for pod in pods]


def _executable() -> str:
    beside = Path(sys.executable).with_name(_VLLM)
    if beside.exists():
        return str(beside)
    found = shutil.which(_VLLM)
    if found is None:
        raise PeerStartError("vllm-router is not installed: pip install -e '.[bench]'.")
    return found


async def _ready(
    name: str, url: str, workers: Sequence[str], process: asyncio.subprocess.Process
) -> None:
    """Poll `/workers` until every worker is listed healthy; raise if the router exits.
    Both routers list them alike (`{"workers": [{"url", "is_healthy"}, ...]}`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _READY_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while loop.time() < deadline:
            if process.returncode is not None:
                raise PeerStartError(f"{name} exited with status {process.returncode}.")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}/workers") as response:
                    if response.status == 200:
                        listed = (await response.json()).get("workers", [])
                        healthy = {w["url"] for w in listed if w.get("is_healthy")}
                        if healthy >= set(workers):
                            return
            await asyncio.sleep(_POLL_S)
    raise PeerStartError(f"{name} at {url} did not list {len(workers)} healthy workers.")


@contextlib.asynccontextmanager
async def _running(
    name: str,
    program: tuple[str, ...],
    *,
    shown: str,
    policy: str,
    workers: Sequence[str],
    log_path: Path,
    log_level: str,
) -> AsyncIterator[RunningPeer]:
    """`program` with the flags both routers take alike, on free loopback ports; `shown`
    is the program as a user types it (for `RunningPeer.command`)."""
    port, metrics_port = free_port(), free_port()
    args = (
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
    argv, command, url = (*program, *args), " ".join([shown, *args]), f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=log)
    try:
        await _ready(name, url, workers, process)
        logger.info("%s ready at %s for %d workers.", command, url, len(workers))
        yield RunningPeer(url=url, argv=argv, command=command)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 5)
            except TimeoutError:
                process.kill()
                await process.wait()


@contextlib.asynccontextmanager
async def run_vllm_router(
    policy: str, *, workers: Sequence[str], log_path: Path, log_level: str = "warning"
) -> AsyncIterator[RunningPeer]:
    """`vllm-router --policy <policy>` in front of `workers` (base URLs), on free loopback
    ports, its output (at `log_level`) in `log_path`; yields once every worker is healthy in
    it, and stops the process (by its PID) on exit."""
    async with _running(
        _VLLM,
        (_executable(),),
        shown=_VLLM,
        policy=policy,
        workers=workers,
        log_path=log_path,
        log_level=log_level,
    ) as peer:
        yield peer


@contextlib.asynccontextmanager
async def run_sglang_router(
    policy: str, *, workers: Sequence[str], log_path: Path, log_level: str = "warn"
) -> AsyncIterator[RunningPeer]:
    """`python -m sglang_router.launch_router --policy <policy>` in front of `workers` (base
    URLs of SGLang-flavoured pods), on free loopback ports, its output (at `log_level`) in
    `log_path`; yields once every worker is healthy in it, and stops the process (by its
    PID) on exit."""
    if importlib.util.find_spec("sglang_router") is None:
        raise PeerStartError("sglang-router is not installed: pip install -e '.[bench]'.")
    module = "sglang_router.launch_router"
    async with _running(
        _SGLANG,
        (sys.executable, "-m", module),
        shown=f"python -m {module}",
        policy=policy,
        workers=workers,
        log_path=log_path,
        log_level=log_level,
    ) as peer:
        yield peer


@contextlib.asynccontextmanager
async def run_peer(
    policy: str, *, workers: Sequence[str], log_path: Path
) -> AsyncIterator[RunningPeer]:
    """The router behind benchmark policy `policy` (of PEER_POLICIES) with its `--policy`,
    in front of `workers`, as `run_vllm_router` or `run_sglang_router` start it."""
    run = run_sglang_router if _package(policy) == _SGLANG else run_vllm_router
    async with run(PEER_POLICIES[policy], workers=workers, log_path=log_path) as peer:
        yield peer
