"""Run scenarios × policies × seeds through one real Envoy and collect the figures.

One xDS server and one Envoy serve the whole run. For each scenario and seed the trace is
generated once; then, for each policy in turn, a fresh simulated fleet starts (cold caches,
empty queues), the routing config for that policy is applied and acknowledged by Envoy, and
the trace is replayed by a load generator in its own process. So the policies differ in
nothing but how Envoy (or the oracle) picks pods.

Policies:
  round_robin    Envoy round robin, equal weights (what a Kubernetes Service gives)
  least_request  Envoy least request, equal weights
  project        this project's control plane (today: weighted least request, equal weights;
                 GPU-aware weights arrive with the balancing issue)
  oracle         a router inside the simulator with exact pod state: the limit
  vllm_router_*, sglang_router_*
                 a real per-request router (`vllm-router`, SGLang's `sglang-router`;
                 bench/peers.py) in front of the same pods instead of Envoy, one policy
                 each; asked for by name only

Scenario g (faults) runs its fault schedule beside the replay (`_inject_faults`): the
times are taken from the first request the fleet sees, and reported from the trace's
start. While the killed pod is down, Envoy's admin `/clusters` is polled to find the last
request Envoy sent it. The control-plane restart (`LocalGateway.kill_server` and `start_server`,
an in-process kill: the gRPC server stops without grace) is measured from the new
server's start to Envoy's node being back and holding the new server's version of every
type, and the versions of the new server's first snapshot are compared with the old
server's last.

Scenario g2 (gray failures) runs its schedule beside the replay the same way
(bench/gray.py): a wedged pod, a resetting pod and a pod lying about its KV cache, in
turn; its figures are read from the replay's requests.

Scenario h (hot keys: a trace with `users`) samples every pod's queue beside the replay
(bench/affinity.py) and adds each policy's `key_stickiness` and `spill_reaction_s`.

Scenario f2 (`Scenario.replicas`) runs the project's policy on a gateway of its own
instead: server replicas as separate processes, one Envoy each (bench/replicated.py), the
trace split between the Envoys by bench/split_replay.py, and the Envoys' admitted
concurrency sampled beside the replay. The one Envoy and in-process server of the other
scenarios start only when a scenario needs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.affinity import PodDecision, QueueSampler, group_homes, key_figures
from bench.collector import CollectorPauses, collector_frozen
from bench.gray import gray_figures, inject_gray_faults
from bench.lora_trace import AdapterSampler
from bench.overload import fleet_capacity_tokens_per_s, overload_figures
from bench.peers import PEER_POLICIES, PEER_SESSION_HEADER, peer_pods, peer_versions, run_peer
from bench.pooling import pooled_latencies
from bench.reaction import measure_reaction
from bench.replicated import (
    REPLICAS_NOTES,
    AdmittedSampler,
    FleetRecorder,
    run_replicated_gateway,
    wait_until_agreed,
)
from bench.scenarios import MODEL, Faults, Scenario, build_scenario, pod_capacities
from bench.split_replay import part_of_each_request, run_split_replay_in_subprocess
from llm_sim.fleet import Fleet
from llm_sim.loadgen import ReplayResult, generate_trace, run_replay_in_subprocess, summarize
from llm_sim.loadgen.stats import ttft_sample
from llm_sim.loadgen.trace import Trace
from llm_sim.oracle import OracleRouter
from xds_server.config import RoutingConfig
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot
from xds_testbed.gateway import LocalGateway, run_local_gateway

__all__ = ["ALL_POLICIES", "POLICIES", "RunOptions", "policies_of", "run_benchmark"]

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_request", "project", "oracle")
# Every policy `--policies` accepts: the default ones and the peers.
ALL_POLICIES = (*POLICIES, *PEER_POLICIES)
# The project's pool in every scenario's routing config.
_POOL = "llm"


def policies_of(scenario: Scenario, wanted: Sequence[str]) -> tuple[list[str], list[str]]:
    """The policies of `wanted` that `scenario` runs, and those it leaves out (the oracle
    has no admission for f; f2's replicas share flow control, which only the project has;
    a peer has no Envoy for g's faults to be measured in)."""
    plain = scenario.faults is None and scenario.gray is None and scenario.replicas is None
    runs = scenario.policies or (ALL_POLICIES if plain else POLICIES)
    return [p for p in wanted if p in runs], [p for p in wanted if p not in runs]


# The simulator's step timing is no longer trustworthy when its steps end, on average, this
# much behind their deadlines, or when this much pod time was lost to stalls (re-anchoring).
SIM_STEP_LAG_SATURATED_S = 0.010
SIM_DROPPED_SATURATED_S = 0.5


def _simulator_lag(fleet: Fleet) -> dict[str, float]:
    snapshots = [pod.state_snapshot() for pod in fleet]
    steps = sum(s.steps for s in snapshots)
    return {
        "mean_step_lag_s": sum(s.lag_s_total for s in snapshots) / max(1, steps),
        "max_step_lag_s": max((s.lag_s_max for s in snapshots), default=0.0),
        "dropped_s": sum(s.lag_s_dropped for s in snapshots),
    }


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    scenarios: Sequence[str]
    # The seeds (traces) each scenario runs, in this order.
    seeds: Sequence[int]
    duration_s: float
    out_dir: Path
    request_scale: float = 1.0
    reaction_trials: int = 40
    stream_interval: int = 4
    policies: Sequence[str] = POLICIES
    # `balancing` settings for the project's policy only (the baselines take no metrics).
    project_balancing: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class PolicyRun:
    summary: dict[str, Any]
    # Per-request samples of the measured requests, by bench/pooling.py LATENCIES.
    latencies: dict[str, list[float]]
    saturated: bool
    notes: dict[str, Any]


def _routing(
    scenario: Scenario,
    policy: str,
    endpoints: Sequence[tuple[str, int]],
    *,
    project_balancing: Mapping[str, Any] | None = None,
    pod_names: Mapping[int, str] | None = None,
) -> RoutingConfig:
    """The routing config of one run; `pod_names` (by port) name the endpoints, as the
    Kubernetes inventory does, so that the session ring hashes names, not the ports the
    kernel picked for this run."""
    project = policy == "project"
    flow_control = dict(scenario.flow_control or {}) if project else {}
    return RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "flow_control": flow_control,
            "balancing": {**(scenario.project_balancing or {}), **(project_balancing or {})}
            if project
            else {},
            "updates": {"debounce_s": 0.05, "max_delay_s": 0.2},
            "pools": [
                {
                    "name": _POOL,
                    "models": [MODEL],
                    "adapters": list(scenario.adapters),
                    "balancing": "round_robin" if policy == "round_robin" else "least_request",
                    # Only the project's policy reads the pods' metrics; least_request is
                    # Envoy on its own, with equal weights.
                    "gpu_aware": project,
                    "session_affinity": project and scenario.session_affinity,
                    # What an operator knows of the engines it deployed: their batch limit.
                    "batch_limit": min(pod.profile.max_num_seqs for pod in scenario.pods)
                    if project
                    else None,
                    # And the adapters each holds at once (max_loras, 0 without LoRA).
                    "adapter_slots": (min(pod.profile.max_loras for pod in scenario.pods) or None)
                    if project and scenario.adapters
                    else None,
                    "endpoints": [
                        {"address": host, "port": port, "weight": 1}
                        | ({"name": pod_names[port]} if pod_names and port in pod_names else {})
                        for host, port in endpoints
                    ],
                }
            ],
        }
    )


class _EnvoyVersions:
    """What the benchmark's one Envoy holds, per resource type, across server restarts.

    The registry knows what Envoy ACKed on its current stream. A server restarted with
    unchanged inputs does not answer a reconnecting Envoy's requests that carry the version
    it has (sotw.py), so the types not re-sent are held from before the restart: those are
    `carried` (type short name -> version), taken from the old server's registry at the kill.
    """

    def __init__(self) -> None:
        self.carried: dict[str, str] = {}

    def carry_over(self, gateway: LocalGateway) -> None:
        """Before the server is killed: remember what Envoy holds."""
        for record in gateway.app.registry.streams():
            if record.node_id:
                self.carried.update(record.acked)

    def holds(self, gateway: LocalGateway, resource_type: ResourceType, version: str) -> bool:
        """Envoy's node is connected to the current server and holds `version`."""
        t = resource_type.short
        return any(
            record.acked.get(t) == version
            or (t not in record.sent and self.carried.get(t) == version)
            for record in gateway.app.registry.streams()
            if record.node_id
        )


async def _apply(gateway: LocalGateway, config: RoutingConfig, envoy: _EnvoyVersions) -> None:
    """Hand `config` to the controller and wait until Envoy has ACKed all of it.

    For a GPU-aware pool, also wait until every pod has been scraped once and the weights
    from those metrics are in Envoy: each policy run starts a fresh fleet, and a control
    plane that has never seen its pods is not the steady state being measured.
    """
    app = gateway.app
    app.submit_config(config)
    await _acked(gateway, await asyncio.wait_for(app.controller.settled(), 10), envoy)
    if any(pool.weights_from_metrics for pool in config.pools):
        pods = set(app.scraper.targets)
        # The scraper runs on its own schedule; poll its store.
        while not all((o := app.pods.observations().get(p)) and o.metrics for p in pods):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        app.controller.metrics_changed()
        await _acked(gateway, await asyncio.wait_for(app.controller.settled(), 10), envoy)


def _served(gateway: LocalGateway, snapshot: Snapshot) -> Snapshot:
    """The snapshot the benchmark's Envoy is served now: its own (it has its own admission
    limits with flow control), else the one in force, else `snapshot`."""
    for record in gateway.app.registry.streams():
        entry = gateway.app.cache.entry_for(record.group, record.node_id)
        if record.node_id and entry is not None:
            return entry.snapshot
    return gateway.app.controller.snapshot or snapshot


async def _acked(gateway: LocalGateway, snapshot: Snapshot | None, envoy: _EnvoyVersions) -> None:
    """Wait until Envoy has ACKed `snapshot`, or the one that replaced it: the policy
    re-scores every scrape interval, and Envoy may never ACK a version already replaced."""
    assert snapshot is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    for resource_type in ResourceType:
        while True:
            version = _served(gateway, snapshot).versions[resource_type]
            if envoy.holds(gateway, resource_type, version):
                break
            try:
                await asyncio.wait_for(
                    gateway.app.registry.wait_for_ack(resource_type.short, version), 0.5
                )
                break
            except TimeoutError:
                if loop.time() > deadline:
                    raise


@contextlib.asynccontextmanager
async def _targets(
    scenario: Scenario, policy: str, *, seed: int, stream_interval: int
) -> AsyncIterator[tuple[Fleet, list[tuple[str, int]]]]:
    async with Fleet(
        peer_pods(policy, scenario.pods), model=MODEL, stream_interval=stream_interval, seed=seed
    ) as fleet:
        if policy == "oracle":
            async with OracleRouter(fleet.pods, seed=seed) as oracle:
                yield fleet, [("127.0.0.1", oracle.port)]
        else:
            yield fleet, [("127.0.0.1", pod.port) for pod in fleet.pods]


class _Gateway:
    """The benchmark's one Envoy and in-process server (`LocalGateway`), started when a
    scenario first needs it and stopped with `exit`. Mutable state: `_gateway`."""

    def __init__(self, exit: contextlib.AsyncExitStack, bootstrap_config: Path) -> None:
        self._exit = exit
        self._bootstrap_config = bootstrap_config
        self._gateway: LocalGateway | None = None
        self.envoy = _EnvoyVersions()

    async def get(self) -> LocalGateway:
        if self._gateway is None:
            self._gateway = await self._exit.enter_async_context(
                run_local_gateway(self._bootstrap_config, node_id="bench-envoy", config_poll_s=3600)
            )
        return self._gateway


async def _run_policy(
    gateways: _Gateway,
    scenario: Scenario,
    policy: str,
    *,
    seed: int,
    trace: Trace,
    trace_path: Path,
    options: RunOptions,
    workdir: Path,
) -> PolicyRun:
    first_at_s = trace.requests[0].at_s if trace.requests else 0.0
    stem = trace_path.with_suffix("")
    extra_figures: dict[str, Any] = {}
    # A collection pausing the pods and the server mid-replay is noise: bench/collector.py.
    with collector_frozen() as pauses:
        async with _targets(
            scenario, policy, seed=seed, stream_interval=options.stream_interval
        ) as (
            fleet,
            endpoints,
        ):
            config = _routing(
                scenario,
                policy,
                endpoints,
                project_balancing=options.project_balancing,
                pod_names={pod.port: pod.name for pod in fleet.pods},
            )
            counters = _CounterSampler(fleet)
            if policy in PEER_POLICIES:
                async with counters.running():
                    result, extra_figures = await _replay_on_peer(
                        scenario, policy, endpoints, trace_path=trace_path, workdir=workdir
                    )
                sim_lag = _simulator_lag(fleet)
                end = _EngineCounters.of(fleet)
            elif scenario.replicas is not None:
                async with counters.running():
                    result, extra_figures = await _replay_on_replicas(
                        scenario, config, fleet, trace=trace, trace_path=trace_path, workdir=workdir
                    )
                sim_lag = _simulator_lag(fleet)
                end = _EngineCounters.of(fleet)
            else:
                gateway = await gateways.get()
                queues = QueueSampler(
                    fleet, decision=_pod_decisions(gateway, fleet) if policy == "project" else None
                )
                adapters = AdapterSampler(
                    fleet, placement=_pod_adapters(gateway, fleet) if policy == "project" else None
                )
                # Keyed scenarios keep the pods' queues and the server's spills, to tell a
                # spill from a moved key after the run (bench/results/bounded-load).
                keyed = bool(scenario.trace.users) or scenario.session_affinity
                async with (
                    queues.running() if keyed else contextlib.nullcontext(),
                    adapters.running() if scenario.adapters else contextlib.nullcontext(),
                ):
                    result, fault_figures, sim_lag, end = await _replay_on_gateway(
                        gateway,
                        scenario,
                        policy,
                        fleet,
                        config,
                        counters,
                        trace_path=trace_path,
                        first_at_s=first_at_s,
                        options=options,
                        envoy=gateways.envoy,
                    )
                extra_figures.update(fault_figures)
                slack = config.balancing.queue_slack
                if scenario.trace.users:
                    extra_figures.update(
                        key_figures(
                            trace,
                            result,
                            episodes=queues.episodes(slack=slack),
                            spilled=queues.spilled,
                            warmup_s=scenario.warmup_s,
                        )
                    )
                if keyed:
                    queues.save(stem.with_name(f"{stem.name}-{policy}-queues.json"), slack=slack)
                if scenario.adapters:
                    # Which adapter waited where (bench/lora_trace.py).
                    adapters.save(
                        stem.with_name(f"{stem.name}-{policy}-adapters.json"),
                        started_at_unix=result.started_at_unix,
                    )
            # Every request's pod and times, beside the trace, to see after a run why a figure
            # is what it is.
            result.save(stem.with_name(f"{stem.name}-{policy}-results.json"))
    if scenario.trace.prefix_groups is not None:
        extra_figures["group_homes"] = group_homes(
            trace, result, pods=[pod.name for pod in scenario.pods], warmup_s=scenario.warmup_s
        )
    return _policy_run(scenario, result, counters, end, sim_lag, extra_figures, pauses)


def _pod_decisions(gateway: LocalGateway, fleet: Fleet) -> Callable[[], dict[str, PodDecision]]:
    """A function giving each pod's weight, `spilling` (off the session table), ring
    weight and its pool's `keys_suspended` in the server's current decision, by pod name,
    for the keyed scenarios' sampler."""
    names = {pod.port: pod.name for pod in fleet.pods}

    def decision() -> dict[str, PodDecision]:
        pool = gateway.app.controller.decision.pools.get(_POOL)
        if pool is None:
            return {}
        return {
            names.get(e.port, e.id): PodDecision(
                e.weight, e.spilling, e.ring_weight, pool.keys_suspended
            )
            for e in pool.endpoints
        }

    return decision


def _pod_adapters(gateway: LocalGateway, fleet: Fleet) -> Callable[[], dict[str, tuple[str, ...]]]:
    """A function giving the adapters each pod is advertised with in the server's current
    decision, by pod name, for the LoRA sampler."""
    names = {pod.port: pod.name for pod in fleet.pods}

    def placement() -> dict[str, tuple[str, ...]]:
        pool = gateway.app.controller.decision.pools.get(_POOL)
        if pool is None:
            return {}
        return {names.get(e.port, e.id): e.adapters for e in pool.endpoints}

    return placement


async def _replay_on_gateway(
    gateway: LocalGateway,
    scenario: Scenario,
    policy: str,
    fleet: Fleet,
    config: RoutingConfig,
    counters: _CounterSampler,
    *,
    trace_path: Path,
    first_at_s: float,
    options: RunOptions,
    envoy: _EnvoyVersions,
) -> tuple[ReplayResult, dict[str, Any], dict[str, float], _EngineCounters]:
    """The trace replayed through the benchmark's one Envoy, with `config` applied (and
    scenario g's faults beside it); returns the replay, the fault figures, the simulator's
    lag and the fleet's counters at the end."""
    await _apply(gateway, config, envoy)
    async with counters.running(), contextlib.AsyncExitStack() as stack:
        faults: asyncio.Task[dict[str, Any]] | None = None
        if scenario.faults is not None:
            faults = asyncio.create_task(
                _inject_faults(
                    gateway,
                    fleet,
                    config,
                    envoy,
                    faults=scenario.faults,
                    first_at_s=first_at_s,
                )
            )
            stack.push_async_callback(_cancel, faults)
        elif scenario.gray is not None:
            faults = asyncio.create_task(
                inject_gray_faults(
                    gateway, fleet, scenario.gray, pool=_POOL, first_at_s=first_at_s
                )
            )
            stack.push_async_callback(_cancel, faults)
        result: ReplayResult = await run_replay_in_subprocess(
            trace_path,
            url=gateway.url,
            timeout_s=scenario.drain_s,
            max_in_flight=5000,
        )
        fault_figures = await _fault_figures(faults) if faults else {}
        if scenario.gray is not None:
            pods = [pod.name for pod in fleet.pods]
            fault_figures = gray_figures(result, scenario.gray, pods, fault_figures)
    sim_lag = _simulator_lag(fleet)
    # Retire the pods before they stop, as a drained deployment would.
    gateway.app.submit_config(
        _routing(scenario, policy, [], project_balancing=options.project_balancing)
    )
    end = _EngineCounters.of(fleet)
    return result, fault_figures, sim_lag, end


async def _replay_on_peer(
    scenario: Scenario,
    policy: str,
    endpoints: Sequence[tuple[str, int]],
    *,
    trace_path: Path,
    workdir: Path,
) -> tuple[ReplayResult, dict[str, Any]]:
    """The trace replayed through the peer's router with its `--policy`, in front of the
    same pods (bench/peers.py); the figures name the router's command line."""
    workers = [f"http://{host}:{port}" for host, port in endpoints]
    log_path = workdir / f"{trace_path.stem}-{policy}.log"
    async with run_peer(policy, workers=workers, log_path=log_path) as peer:
        result = await run_replay_in_subprocess(
            trace_path,
            url=peer.url,
            timeout_s=scenario.drain_s,
            max_in_flight=5000,
            cache_key_session=True,
        )
    figures = {"command": peer.command, "session_header": PEER_SESSION_HEADER}
    return result, {"peer": {**figures, **peer_versions([policy])}}


async def _replay_on_replicas(
    scenario: Scenario,
    config: RoutingConfig,
    fleet: Fleet,
    *,
    trace: Trace,
    trace_path: Path,
    workdir: Path,
) -> tuple[ReplayResult, dict[str, Any]]:
    """Scenario f2: the trace split over the Envoys of server replicas that share their
    load (bench/replicated.py), with the admitted concurrency sampled every 100 ms and
    every replica's fleet view kept; the samples, the views and every request's result are
    written to the run's traces folder, beside the trace (`<trace>-admitted.jsonl`,
    `-fleet.jsonl`, `-results.json`), to see after a run why a figure is what it is."""
    replicas = scenario.replicas
    assert replicas is not None
    config_path = workdir / f"{scenario.name}-config.json"
    config_path.write_text(config.model_dump_json())
    async with run_replicated_gateway(config_path, replicas=replicas.names) as gateway:
        await wait_until_agreed(gateway, config=config, pool=_POOL, pods=len(fleet.pods))
        admitted = AdmittedSampler(
            dict(zip(gateway.node_ids, gateway.envoys, strict=True)),
            fleet,
            config=config,
            pool=_POOL,
        )
        views = FleetRecorder(gateway.servers)
        async with admitted.running(), views.running():
            result = await run_split_replay_in_subprocess(
                trace_path,
                urls=gateway.urls,
                shares=replicas.split,
                timeout_s=scenario.drain_s,
                max_in_flight=5000,
                wait_timeout_s=scenario.trace.duration_s + scenario.drain_s + 60.0,
            )
        node_ids = gateway.node_ids
    start = result.started_at_unix
    stem = trace_path.with_suffix("")
    admitted.save(stem.with_name(f"{stem.name}-admitted.jsonl"), started_at_unix=start)
    views.save(stem.with_name(f"{stem.name}-fleet.jsonl"), started_at_unix=start)
    result.save(stem.with_name(f"{stem.name}-results.json"))
    parts = part_of_each_request(trace, shares=replicas.split)
    by_envoy: dict[str, Any] = {}
    for i, node_id in enumerate(node_ids):
        mine = [r for r in result.results if parts[r.index] == i]
        by_envoy[node_id] = {
            "requests": len(mine),
            "status_counts": dict(sorted(Counter(r.outcome for r in mine).items())),
            "refused_by_band": dict(
                sorted(Counter(r.band for r in mine if r.status == 429).items())
            ),
        }
    figures = {
        **admitted.figures(started_at_unix=start),
        **views.figures(pool=_POOL),
        "envoys": len(node_ids),
        "replicas": list(replicas.names),
        "split": {
            "shares": dict(zip(node_ids, replicas.split, strict=True)),
            "by_envoy": by_envoy,
        },
    }
    return result, figures


def _policy_run(
    scenario: Scenario,
    result: ReplayResult,
    counters: _CounterSampler,
    end: _EngineCounters,
    sim_lag: dict[str, float],
    extra_figures: Mapping[str, Any],
    pauses: CollectorPauses,
) -> PolicyRun:
    warmup_s = scenario.warmup_s
    measured = [r for r in result.results if r.scheduled_at_s >= warmup_s]
    summary = summarize(measured, duration_s=scenario.trace.duration_s - warmup_s).to_json()
    served_by = Counter(r.backend_id or "none" for r in measured if r.status == 200)
    summary["served_by"] = dict(sorted(served_by.items()))
    summary.update((end - counters.at(result.started_at_unix + warmup_s)).figures())
    if warmup_s:
        whole = summarize(result.results, duration_s=scenario.trace.duration_s)
        summary["warmup_s"] = warmup_s
        summary["whole_run"] = {
            "ttft_p95_s": whole.ttft_p95_s,
            "ttft_p99_s": whole.ttft_p99_s,
            **end.figures(),
        }
    if scenario.windows is not None:
        summary.update(overload_figures(result.results, windows=scenario.windows))
    summary.update(extra_figures)
    ttfts = [t for r in measured if (t := ttft_sample(r)) is not None]
    # As `summarize` takes them: TPOT and end-to-end of the successful requests.
    ok = [r for r in measured if r.ok]
    latencies = {
        "ttft": ttfts,
        "tpot": [t for r in ok if (t := r.tpot_s) is not None],
        "e2e": [t for r in ok if (t := r.e2e_s) is not None],
    }
    saturated = (
        result.saturated
        or sim_lag["mean_step_lag_s"] > SIM_STEP_LAG_SATURATED_S
        or sim_lag["dropped_s"] > SIM_DROPPED_SATURATED_S
    )
    notes = {
        "loadgen_loop_lag_p99_s": result.loop_lag_p99_s,
        "loadgen_send_lateness_p99_s": result.send_lateness_p99_s,
        "simulator": sim_lag,
        "collector": pauses.to_json(),
        "saturated": saturated,
    }
    return PolicyRun(summary=summary, latencies=latencies, saturated=saturated, notes=notes)


async def _fault_figures(faults: asyncio.Task[dict[str, Any]]) -> dict[str, Any]:
    """The fault schedule's figures once it is done. A step that hangs fails the run, naming
    where it waits, rather than stalling it (see bench/results/g/NOTES.md)."""
    try:
        return await asyncio.wait_for(asyncio.shield(faults), _FAULTS_AFTER_REPLAY_S)
    except TimeoutError:
        raise RuntimeError(
            f"The fault schedule was not done {_FAULTS_AFTER_REPLAY_S:g} s after the replay; "
            f"it waits at: {' <- '.join(reversed(_awaiting(faults)))}"
        ) from None


def _awaiting(task: asyncio.Task[Any]) -> list[str]:
    """Where `task` is suspended, outermost coroutine first (file:line in function)."""
    places = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        if isinstance(awaited, asyncio.Task):
            awaited = awaited.get_coro()
        frame = getattr(awaited, "cr_frame", None)
        if frame is None:
            places.append(type(awaited).__name__)
            break
        places.append(
            f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        )
        awaited = awaited.cr_await
    return places


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# How often Envoy's admin is asked for the dead pod's counters, and for how long at most the
# restarted control plane is waited for.
_DEAD_POD_POLL_S = 0.015
_RECONNECT_TIMEOUT_S = 20.0
# How long the fault schedule may still run once the replay has ended.
_FAULTS_AFTER_REPLAY_S = 30.0
# Per-host counters that grow when Envoy sends the host a request or tries to connect to it.
_HOST_REQUEST_COUNTERS = frozenset({"rq_total", "cx_connect_fail", "rq_error"})


async def _inject_faults(
    gateway: LocalGateway,
    fleet: Fleet,
    config: RoutingConfig,
    envoy: _EnvoyVersions,
    *,
    faults: Faults,
    first_at_s: float,
) -> dict[str, Any]:
    """Run `faults` against the fleet and the control plane while the trace replays, and
    measure what Envoy did about them.

    Offset 0 is the trace's start: the moment the fleet sees its first request, less that
    request's offset (`first_at_s`). Returns the figures for results.json: the fault
    times, `requests_to_dead_pod_after_s` (kill to the last increase of the dead pod's
    request or connect-failure counters in Envoy, seen by polling admin every 15 ms: an
    upper bound by up to one poll), `versions_changed_on_restart`, `reconnect_s` (None
    when Envoy was not back within 20 s), and the connections each pod fault cut.
    """
    loop = asyncio.get_running_loop()
    while not any(pod.state_snapshot().in_flight for pod in fleet):  # noqa: ASYNC110
        await asyncio.sleep(0.002)
    start = loop.time() - first_at_s

    async def at(offset_s: float) -> None:
        await asyncio.sleep(max(0.0, start + offset_s - loop.time()))

    dead = fleet[faults.kill_pod]
    await at(faults.kill_s)
    before = await _host_counters(gateway, dead.port)
    killed_at = loop.time()
    killed_connections = await dead.kill()
    watch = asyncio.create_task(_last_increase(gateway, dead.port, before))
    await at(faults.reset_s)
    reset_at = loop.time()
    reset_connections = fleet[faults.reset_pod].reset_prefilling()
    await at(faults.revive_s)
    last_request_at = await _stop_watching(watch)
    revived_at = loop.time()
    await dead.revive()
    await at(faults.control_plane_s)
    restart = await _restart_control_plane(
        gateway, config, envoy, down_s=faults.control_plane_down_s
    )
    return {
        "faults": {
            "kill_s": killed_at - start,
            "killed_pod": faults.kill_pod,
            "killed_connections": killed_connections,
            "reset_s": reset_at - start,
            "reset_pod": faults.reset_pod,
            "reset_connections": reset_connections,
            "revive_s": revived_at - start,
            "control_plane_kill_s": restart.pop("killed_at") - start,
        },
        "requests_to_dead_pod_after_s": max(0.0, (last_request_at or killed_at) - killed_at),
        **restart,
    }


async def _host_counters(gateway: LocalGateway, port: int) -> int:
    """The sum of `_HOST_REQUEST_COUNTERS` over every Envoy cluster's host on `port`."""
    document = await gateway.envoy.clusters_json()
    total = 0
    for cluster in document.get("cluster_statuses", []):
        for host in cluster.get("host_statuses", []):
            if host.get("address", {}).get("socket_address", {}).get("port_value") != port:
                continue
            total += sum(
                int(stat.get("value", 0))
                for stat in host.get("stats", [])
                if stat.get("name") in _HOST_REQUEST_COUNTERS
            )
    return total


async def _last_increase(gateway: LocalGateway, port: int, baseline: int) -> float | None:
    """Poll the counters of the host on `port` until cancelled; the task's result, through
    `_stop_watching`, is the loop time of the last poll that saw them grow (None: never)."""
    last: float | None = None
    try:
        while True:
            await asyncio.sleep(_DEAD_POD_POLL_S)
            value = await _host_counters(gateway, port)
            if value > baseline:
                baseline, last = value, asyncio.get_running_loop().time()
    except asyncio.CancelledError:
        return last


async def _stop_watching(watch: asyncio.Task[float | None]) -> float | None:
    watch.cancel()
    return await watch


async def _restart_control_plane(
    gateway: LocalGateway, config: RoutingConfig, envoy: _EnvoyVersions, *, down_s: float
) -> dict[str, Any]:
    """Kill the server, start a new one on the same port `down_s` later with the same config
    (written where it reads its config at start), and wait for Envoy to be back on it:
    connected, and holding the new server's version of every type."""
    loop = asyncio.get_running_loop()
    old = gateway.app
    old_snapshot = old.controller.snapshot
    assert old_snapshot is not None and old.settings.config_path is not None
    envoy.carry_over(gateway)
    old.settings.config_path.write_text(config.model_dump_json())
    killed_at = loop.time()
    await gateway.kill_server()
    await asyncio.sleep(max(0.0, killed_at + down_s - loop.time()))
    # From just before the new server binds: at most a few ms more than from listening.
    started = loop.time()
    app = await gateway.start_server()
    first: dict[ResourceType, str] | None = None
    reconnect_s: float | None = None
    while loop.time() - started < _RECONNECT_TIMEOUT_S:
        snapshot = app.controller.snapshot
        if snapshot is not None:
            first = first or dict(snapshot.versions)
            if all(envoy.holds(gateway, t, v) for t, v in snapshot.versions.items()):
                reconnect_s = loop.time() - started
                break
        await asyncio.sleep(0.005)
    changed = None
    if first is not None:
        changed = sorted(t.short for t, v in first.items() if old_snapshot.versions[t] != v)
    return {
        "killed_at": killed_at,
        "reconnect_s": reconnect_s,
        "versions_changed_on_restart": changed,
    }


@dataclass(frozen=True)
class _EngineCounters:
    """The fleet's cumulative prefix-cache and adapter counters at one moment."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    adapter_loads: int = 0
    adapter_requests: int = 0
    adapter_hits: int = 0

    @classmethod
    def of(cls, fleet: Fleet) -> _EngineCounters:
        engines = [pod.state_snapshot().engine for pod in fleet]
        return cls(*(sum(getattr(e, f.name) for e in engines) for f in dataclasses.fields(cls)))

    def __sub__(self, other: _EngineCounters) -> _EngineCounters:
        return _EngineCounters(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def figures(self) -> dict[str, Any]:
        return {
            "prefix_cache_hit_rate": self.prefix_cache_hits / max(1, self.prefix_cache_queries),
            "adapter_loads": self.adapter_loads,
            "adapter_hit_fraction": self.adapter_hits / self.adapter_requests
            if self.adapter_requests
            else None,
        }


class _CounterSampler:
    """Samples the fleet's counters while a trace replays, so that figures can start at the
    end of a scenario's warm-up (the replay runs in another process, on wall-clock time)."""

    INTERVAL_S = 0.1

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._samples: list[tuple[float, _EngineCounters]] = []

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async def sample() -> None:
            while True:
                self._samples.append((time.time(), _EngineCounters.of(self._fleet)))
                await asyncio.sleep(self.INTERVAL_S)

        task = asyncio.create_task(sample())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def at(self, unix_time: float) -> _EngineCounters:
        """The last sample taken at or before `unix_time` (zeros before the first)."""
        before = [counters for t, counters in self._samples if t <= unix_time]
        return before[-1] if before else _EngineCounters()


# Fault figures, and f2's excess over the pool limit, merge to the worst seed, not the
# median: a failure in one seed is a failure.
_SUMMED_OVER_SEEDS = frozenset(
    {"failed_before_headers", "cut_streams", "cut_streams_without_tokens", "non_json_errors"}
)
_WORST_OVER_SEEDS = frozenset(
    {
        "requests_to_dead_pod_after_s",
        "reconnect_s",
        "max_admitted_over_limit",
        "max_all_bands_over_limit",
    }
)


# Session-key figures (bench/affinity.py): dicts of figures, merged leaf by leaf
# (`_merge_nested`).
_NESTED_FIGURES = frozenset({"key_stickiness", "spill_reaction_s", "group_homes"})
_COUNTS = frozenset(
    {
        "episodes",
        "spilled",
        "unspilled",
        "idle",
        "undecided",
        "short_episodes",
        "keys",
        "requests",
        "off_home_requests",
    }
)


def _merge_nested(values: Sequence[Any], key: str = "") -> Any:
    """Dicts merged key by key, lists of one length item by item; numbers to the worst
    seed's for `min` and `max` (and `*_max`, `*_max_s`, `*_longest_s`), the sum for counts
    (`_COUNTS`), else the median; anything else (a pod's name) the first seed's. None in
    a seed is left out."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, list) for v in present) and len({len(v) for v in present}) == 1:
        return [_merge_nested(column, key) for column in zip(*present, strict=True)]
    if all(isinstance(v, dict) for v in present):
        keys = sorted({k for v in present for k in v})
        return {k: _merge_nested([v.get(k) for v in present], k) for k in keys}
    if not all(isinstance(v, int | float) for v in present):
        return present[0]
    if key == "min":
        return min(present)
    if key == "max" or key.endswith(("_max", "_max_s", "_longest_s")):
        return max(present)
    if key in _COUNTS:
        return sum(present)
    return statistics.median(present)


def _merge_seeds(runs: Sequence[PolicyRun]) -> dict[str, Any]:
    """The median over seeds of every numeric figure, with per-seed values under `per_seed`.

    Fault counts are summed, the fault times are the worst seed's (None if a seed never
    reconnected), and the types re-versioned on restart are the union over seeds; the
    session-key figures are merged by `_merge_nested`.
    """
    if len(runs) == 1:
        return {**runs[0].summary, "run": runs[0].notes}
    merged: dict[str, Any] = {}
    per_seed: dict[str, list[Any]] = {}
    for key, first in runs[0].summary.items():
        values = [run.summary[key] for run in runs]
        per_seed[key] = values
        numeric = [v for v in values if isinstance(v, int | float)]
        if key in _SUMMED_OVER_SEEDS:
            merged[key] = sum(numeric)
        elif key in _WORST_OVER_SEEDS:
            merged[key] = None if None in values else max(numeric)
        elif key == "versions_changed_on_restart":
            merged[key] = None if None in values else sorted({t for v in values for t in v})
        elif isinstance(first, int | float) and numeric:
            merged[key] = statistics.median(numeric)
        elif key in _NESTED_FIGURES:
            merged[key] = _merge_nested(values)
        elif key in ("status_counts", "served_by"):
            merged[key] = {
                k: sum(v.get(k, 0) for v in values) for k in sorted({k for v in values for k in v})
            }
        else:
            merged[key] = first
    merged["per_seed"] = per_seed
    merged["run"] = [run.notes for run in runs]
    return merged


async def run_benchmark(
    options: RunOptions, *, progress: Callable[[str], None] = lambda _: None
) -> tuple[dict[str, Any], dict[str, dict[str, list[float]]], dict[str, str]]:
    """Run everything; returns (results.json content, TTFT samples per scenario/policy, titles)."""
    options.out_dir.mkdir(parents=True, exist_ok=True)
    traces_dir = options.out_dir / "traces"
    traces_dir.mkdir(exist_ok=True)
    results: dict[str, Any] = {"scenarios": {}, "machine_saturated": False}
    samples: dict[str, dict[str, list[float]]] = {}
    titles: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="xds-bench-") as workdir:
        bootstrap_config = Path(workdir) / "config.yaml"
        first = build_scenario(options.scenarios[0], duration_s=options.duration_s)
        bootstrap_config.write_text(
            _routing(first, "least_request", [("127.0.0.1", 9)]).model_dump_json()
        )
        async with contextlib.AsyncExitStack() as exit:
            gateways = _Gateway(exit, bootstrap_config)
            for name in options.scenarios:
                scenario = build_scenario(
                    name, duration_s=options.duration_s, request_scale=options.request_scale
                )
                titles[name] = scenario.title
                policies, skipped = policies_of(scenario, options.policies)
                if skipped:
                    progress(
                        f"scenario {name}: skipping {', '.join(skipped)}"
                        f" (it runs only {', '.join(scenario.policies or POLICIES)})"
                    )
                runs: dict[str, list[PolicyRun]] = {p: [] for p in policies}
                for seed in options.seeds:
                    trace = generate_trace(scenario.trace, seed=seed)
                    trace_path = traces_dir / f"{name}-seed{seed}.jsonl"
                    trace.save(trace_path)
                    for policy in policies:
                        count = len(trace.requests)
                        progress(f"scenario {name}, seed {seed}, {policy}: {count} requests")
                        run = await _run_policy(
                            gateways,
                            scenario,
                            policy,
                            seed=seed,
                            trace=trace,
                            trace_path=trace_path,
                            options=options,
                            workdir=Path(workdir),
                        )
                        runs[policy].append(run)
                        results["machine_saturated"] |= run.saturated
                results["scenarios"][name] = {
                    "title": scenario.title,
                    "capacity_requests_per_s": scenario.capacity_requests_per_s,
                    "offered_requests_per_s": scenario.trace.rate_per_s,
                    "pods": [
                        {"name": p.name, "profile": p.profile.name, "capacity_requests_per_s": c}
                        for p, c in zip(
                            scenario.pods, pod_capacities(scenario).values(), strict=True
                        )
                    ],
                    "policies": {
                        p: {
                            **_merge_seeds(r),
                            "pooled": pooled_latencies([run.latencies for run in r]),
                        }
                        for p, r in runs.items()
                    },
                }
                if scenario.replicas is not None:
                    results["scenarios"][name]["notes"] = dict(REPLICAS_NOTES)
                if scenario.windows is not None:
                    progress(f"scenario {name}: single-pod saturation probes for capacity")
                    # The trace's own request lengths, in the trace's order.
                    shapes = [(r.prompt_words, r.max_tokens) for r in trace.requests]
                    results["scenarios"][name].update(
                        await fleet_capacity_tokens_per_s(
                            scenario.pods,
                            model=MODEL,
                            shapes=shapes,
                            warmup_s=15.0 * min(1.0, options.request_scale),
                            window_s=10.0 * min(1.0, options.request_scale),
                        )
                    )
                samples[name] = {
                    p: [t for run in r for t in run.latencies["ttft"]] for p, r in runs.items()
                }
    if set(options.policies) & set(PEER_POLICIES):
        results["peer_versions"] = peer_versions(options.policies)
    if "project" in options.policies:
        progress("reaction time: pod metrics change -> Envoy applies the new weight")
        reaction = await measure_reaction(trials=options.reaction_trials)
        results["reaction"] = reaction
        for scenario_results in results["scenarios"].values():
            project = scenario_results["policies"].get("project")
            if project is None:
                continue
            project["reaction_p50_s"] = reaction["reaction_p50_s"]
            project["reaction_p99_s"] = reaction["reaction_p99_s"]
    return results, samples, titles
