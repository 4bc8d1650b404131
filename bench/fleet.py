"""`python -m bench.fleet`: how the server copes with the size of its fleet.

A fleet of P pools of E endpoints in all (default 100 pools, 10,000 endpoints) is served by
the real server (`python -m xds_server run`, a process of its own) to N ADS clients that
speak ADS and ACK as Envoy does (bench/fleet_clients.py, up to 100 per child process) and to
one real Envoy among them. Most pools are static (`gpu_aware: false`; endpoints on
127.0.0.1 ports nobody listens on, never contacted: Envoy carries no traffic here). The
first pools hold `--scraped-pods` GPU-aware pods (default 200, i.e. two pools), whose
`/metrics` are served by the harness itself (bench/fleet_pods.py) and which the server
scrapes every `balancing.scrape_interval_s`. The config sets `balancing.smoothing` to 1, so
that one change of a pod's page is exactly one EDS push (with the default smoothing a
change is a run of pushes, each a step of the EWMA, and the next change's push could not be
told apart from the previous change's tail); the debounce stays the default
(`updates.debounce_s`, reported), and is part of every push latency below.

Phases, in order, each against a fresh server per run:

1. connect: every client opens its stream at once (a connect storm). `connect_all_s` runs
   from then until the last client has its full first config (CDS, EDS of every cluster,
   LDS, RDS, RTDS, all ACKed), bounded (60 s); `clients_served` says how many made it.
   The real Envoy starts before the storm (`envoy_live_s`: process start to LIVE).
2. idle: nothing changes for `--idle-s` (pods' pages constant). `idle_cpu_cores` is the
   server's CPU over the window divided by its length. The pods' metrics ages
   (`xds_pod_metrics_age_seconds`, one gauge per scraped pod) are sampled from /metrics
   every 2 s: `signal_age_p99_s` and `signal_age_max_s` over all samples.
   `scraped_pods_per_core` = (successful scrapes in the window, from
   `xds_scrape_duration_seconds_count`, / server CPU seconds in the window) ×
   scrape_interval_s: how many pods one core could keep at this interval if scraping were
   all it did. Every CPU second of the window is charged to scraping (ADS keepalives, the
   config poll, the harness's own /metrics reads too), so the figure is a lower bound.
3. changes (`--changes`, default 20, at least 1 s apart): one GPU-aware pod's page flips
   between idle and busy (a queue of 40 and 95% KV use), so its weight changes. T1 is the
   moment the pod served the changed page for the first time (the scrape that saw it);
   the figures run from T1 to the first and to the last ACK of a new EDS version by the
   clients that are connected and served (`change_to_first_ack_*`, `change_to_last_ack_*`,
   the time each client wrote its ACK). A change with no new EDS version at any client
   within 5 s of T1 (or never scraped) is a `missed_pushes`; one that some client did not
   ACK within the bound is an `incomplete_pushes`. `cpu_s_per_push` is the server's CPU
   over the phase divided by the pushes seen; `cpu_s_per_push_over_idle` first takes off
   what the idle rate would have cost over the same time (scraping goes on meanwhile; when
   a push costs less than the noise in that, this comes out near 0 or below).
   `sotw_eds_bytes_per_push` (the name stays for Delta runs; see `protocol`) is the mean
   size of the EDS response one client got for one push, `eds_resources_per_push` the
   ClusterLoadAssignments in it.
4. config changes (`--config-changes`, default 5): the config file is rewritten
   atomically (a temporary file renamed over it) with one static endpoint's weight
   toggled; T0 is the rename. `config_change_to_last_ack_*` runs from T0 to the last
   client's ACK of the new EDS version; it includes the server's file poll
   (`config_poll_s`, passed as `--config-poll`), the parse in a child process and the
   debounce. `config_missed` and `config_incomplete` count as for metrics changes (bound
   15 s after the poll), and `config_change_types` lists the types that got a new version
   in this phase.

Throughout: `loop_stall_max_s` is the longest event-loop stall after the server was ready,
from its `xds_event_loop_lag_seconds` histogram (the upper bound of the highest bucket
that gained samples, or the largest-lag gauge when that is lower; per phase in
`loop_stall_max_s_by_phase`), `loop_stalls_over_50ms`
the lag samples above 50 ms in that time, and `loop_lag_max_gauge_s` the server's own
largest lag since it started (`xds_event_loop_lag_max_seconds`); all null if the server
does not export them. `rss_mb` is the server's resident memory at the end, `nacks` every
NACK it counted, and `envoy_in_step` whether the real Envoy ACKed the same EDS version as
the clients at the end. `responses_by_type` and `received_mb_by_type` count what all the
clients received over the run. `harness_lag_max_s` is the harness's own largest
event-loop lag (it serves the pods; a stall there would delay scrapes and T1).

A client whose stream ends is not reconnected (Envoy would reconnect, adding load): it
counts in `clients_disconnected` and no longer in the push figures.

Times are `time.monotonic()`, one clock for every process on Linux. Everything runs on one
machine: the clients' own work (each parses every response it gets, and hundreds of them
get each push) competes with the server for the same cores, a pessimistic bias.

    python -m bench.fleet [--pools 100] [--endpoints 10000] [--clients 500[,1000]]
        [--protocol sotw[,delta] | --delta] [--flow-control] [--scraped-pods 200]
        [--changes 20] [--config-changes 5] [--idle-s 10] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fleet_clients import AckSeen, ClientGroup, ResponseRecord
from bench.fleet_pods import BUSY, IDLE, FakePods
from bench.fleet_probe import ServerProbe, ServerReading, stall_bound
from xds_server.config import RoutingConfig, UpdatesConfig
from xds_server.envoy import render_bootstrap
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.server_process import ServerProcess

__all__ = [
    "FleetLayout",
    "FleetResult",
    "FleetSpec",
    "fleet_document",
    "main",
    "percentile",
    "run_fleet",
    "specs_of",
]

logger = logging.getLogger(__name__)

NODE_CLUSTER = "fleet"
ENVOY_NODE_ID = "fleet-envoy"
# Static endpoints' ports: 127.0.0.1:STATIC_PORT_BASE + k for the k-th of a pool.
STATIC_PORT_BASE = 20_000
# The harness reads the server's /metrics at most this often: at 100 pools and 500 Envoys
# the page is ~6,000 series, ~0.1 s of the server's CPU per read (in a worker thread), and
# that is in the idle figure; Prometheus reads it every 15-30 s.
_PROBE_INTERVAL_S = 2.0


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    """One run's fleet, clients and phases (module docstring)."""

    pools: int = 100
    endpoints: int = 10_000
    clients: int = 500
    scraped_pods: int = 200
    flow_control: bool = False
    delta: bool = False
    changes: int = 20
    config_changes: int = 5
    idle_s: float = 10.0
    scrape_interval_s: float = 0.25
    config_poll_s: float = 0.25
    change_spacing_s: float = 1.0
    push_bound_s: float = 5.0
    config_bound_s: float = 15.0
    connect_bound_s: float = 60.0
    clients_per_process: int = 100

    @property
    def protocol(self) -> str:
        return "delta" if self.delta else "sotw"


@dataclass(frozen=True, kw_only=True)
class FleetLayout:
    """Endpoints per pool: the first `gpu_aware` pools hold the scraped pods, spread
    evenly; the others the static endpoints, spread evenly."""

    sizes: tuple[int, ...]
    gpu_aware: int

    @classmethod
    def of(cls, spec: FleetSpec) -> FleetLayout:
        """Raises ValueError when the sizes cannot be laid out (a pool would be empty)."""
        if spec.pools < 1 or spec.endpoints < spec.pools:
            raise ValueError("need at least one pool and one endpoint per pool")
        if not 0 <= spec.scraped_pods <= spec.endpoints:
            raise ValueError("--scraped-pods must be between 0 and --endpoints")
        per_pool = spec.endpoints // spec.pools
        gpu_aware = math.ceil(spec.scraped_pods / per_pool)
        static_pools = spec.pools - gpu_aware
        static = spec.endpoints - spec.scraped_pods
        if (static_pools == 0) != (static == 0) or static < static_pools:
            raise ValueError(
                f"cannot spread {static} static endpoints over {static_pools} pools"
                f" next to {spec.scraped_pods} scraped pods in {gpu_aware} pools"
            )
        if spec.changes and not spec.scraped_pods:
            raise ValueError("metrics changes need a scraped pod (--scraped-pods)")
        if spec.config_changes and not static:
            raise ValueError("config changes need a static endpoint")
        if static_pools and math.ceil(static / static_pools) > 65_535 - STATIC_PORT_BASE:
            raise ValueError("too many static endpoints per pool for their ports")
        return cls(
            sizes=(*_spread(spec.scraped_pods, gpu_aware), *_spread(static, static_pools)),
            gpu_aware=gpu_aware,
        )


def _spread(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def fleet_document(
    spec: FleetSpec,
    layout: FleetLayout,
    *,
    pod_ports: Sequence[int],
    toggled_weight: int = 1,
) -> dict[str, Any]:
    """The routing config of the fleet: GPU-aware pools on `pod_ports` (in order), then the
    static pools; the first endpoint of the last static pool has `toggled_weight`."""
    ports = iter(pod_ports)
    pools = []
    for index, size in enumerate(layout.sizes):
        gpu_aware = index < layout.gpu_aware
        endpoints: list[dict[str, Any]] = [
            {"address": "127.0.0.1", "port": next(ports) if gpu_aware else STATIC_PORT_BASE + k}
            for k in range(size)
        ]
        if index == len(layout.sizes) - 1 and not gpu_aware and toggled_weight != 1:
            endpoints[0]["weight"] = toggled_weight
        pools.append(
            {
                "name": f"pool-{index:03d}",
                "models": [f"model-{index}"],
                "gpu_aware": gpu_aware,
                "endpoints": endpoints,
            }
        )
    return {
        "listener": {"address": "127.0.0.1", "port": 0},
        "balancing": {"scrape_interval_s": spec.scrape_interval_s, "smoothing": 1.0},
        "flow_control": {"enabled": spec.flow_control},
        "pools": pools,
    }


def _write_atomically(path: Path, text: str) -> float:
    """Write `text` to a temporary file beside `path` and rename it over `path`; returns
    the monotonic time of the rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
    return time.monotonic()


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` quantile (0 < q <= 1) of `samples`; None when there are none."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- results -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FleetResult:
    """One run's figures (module docstring); `to_json()` is the `--json` object."""

    protocol: str
    flow_control: bool
    clients: int
    clients_served: int
    clients_disconnected: int
    endpoints: int
    pools: int
    scraped_pods: int
    scrape_interval_s: float
    config_poll_s: float
    debounce_s: float
    connect_all_s: float | None
    connect_p50_s: float | None
    envoy_live_s: float
    changes: int
    missed_pushes: int
    incomplete_pushes: int
    change_to_first_ack_p50_s: float | None
    change_to_first_ack_p99_s: float | None
    change_to_last_ack_p50_s: float | None
    change_to_last_ack_p99_s: float | None
    config_changes: int
    config_missed: int
    config_incomplete: int
    config_change_to_last_ack_p50_s: float | None
    config_change_to_last_ack_p99_s: float | None
    config_change_types: tuple[str, ...]
    cpu_s_per_push: float | None
    cpu_s_per_push_over_idle: float | None
    idle_cpu_cores: float
    loop_stall_max_s: float | None
    loop_stall_max_s_by_phase: Mapping[str, float | None]
    loop_stalls_over_50ms: int | None
    loop_lag_max_gauge_s: float | None
    rss_mb: float
    sotw_eds_bytes_per_push: float | None
    eds_resources_per_push: float | None
    signal_age_p99_s: float | None
    signal_age_max_s: float | None
    scraped_pods_per_core: float | None
    idle_scrapes_per_s: float
    nacks: int
    envoy_in_step: bool
    responses_by_type: Mapping[str, int]
    received_mb_by_type: Mapping[str, float]
    harness_lag_max_s: float
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        document = dataclasses.asdict(self)
        document["config_change_types"] = list(self.config_change_types)
        return document


@dataclass(frozen=True, kw_only=True)
class _Connected:
    clients_served: int
    disconnected: int
    all_s: float | None
    p50_s: float | None


@dataclass(frozen=True, kw_only=True)
class _Idle:
    cpu_cores: float
    ages: tuple[float, ...]
    scrapes: float
    cpu_s: float
    wall_s: float


@dataclass(frozen=True, kw_only=True)
class _Pushes:
    """What a phase of changes saw: per change the latencies to the first and last ACK,
    the ACKs themselves, misses and incomplete pushes, and the last version ACKed."""

    first: tuple[float, ...]
    last: tuple[float, ...]
    acks: tuple[AckSeen, ...]
    missed: int
    incomplete: int
    final_version: str | None


@dataclass
class _Traffic:
    """Every response the clients reported, folded as it comes (mutable: `add`)."""

    responses: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    versions: set[tuple[str, str]] = dataclasses.field(default_factory=set)

    def add(self, records: Sequence[ResponseRecord]) -> set[str]:
        """Fold `records` in; returns the types that got a version not seen before."""
        new = set()
        for record in records:
            self.responses[record.type] = self.responses.get(record.type, 0) + 1
            self.bytes[record.type] = self.bytes.get(record.type, 0) + record.bytes
            key = (record.type, record.version)
            if key not in self.versions:
                self.versions.add(key)
                new.add(record.type)
        return new


class _LagWatch:
    """The harness's own event-loop lag. The pods are served from this loop, so a stall
    here would delay scrapes and T1 and be blamed on the server: it is reported
    (`harness_lag_max_s`) to show that it was not. Mutable state: `max_s`."""

    INTERVAL_S = 0.05

    def __init__(self) -> None:
        self.max_s = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.INTERVAL_S
            await asyncio.sleep(self.INTERVAL_S)
            self.max_s = max(self.max_s, loop.time() - asked)


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# -- phases ------------------------------------------------------------------------------


async def _connect(group: ClientGroup, spec: FleetSpec) -> _Connected:
    began = await group.start()
    reply = await group.await_served(deadline=began + spec.connect_bound_s)
    served = [t - began for t in reply.served_at.values() if t is not None]
    for index, error in sorted(reply.errors.items())[:3]:
        logger.warning("Client %d lost its stream: %s", index, error)
    return _Connected(
        clients_served=len(served),
        disconnected=len(reply.errors),
        all_s=max(served) if len(served) == spec.clients else None,
        p50_s=statistics.median(served) if served else None,
    )


async def _idle(probe: ServerProbe, spec: FleetSpec) -> tuple[_Idle, ServerReading]:
    before = await probe.read()
    started = time.monotonic()
    ages: list[float] = []
    reading = before
    while (remaining := started + spec.idle_s - time.monotonic()) > 0:
        await asyncio.sleep(min(_PROBE_INTERVAL_S, remaining))
        reading = await probe.read()
        ages.extend(reading.pod_ages_s)
    wall = max(1e-9, reading.at - before.at)
    cpu = reading.cpu_s - before.cpu_s
    idle = _Idle(
        cpu_cores=cpu / wall,
        ages=tuple(ages),
        scrapes=reading.scrapes - before.scrapes,
        cpu_s=cpu,
        wall_s=wall,
    )
    return idle, reading


@dataclass
class _Tally:
    """A phase's changes, added one at a time (mutable until `result`)."""

    first: list[float] = dataclasses.field(default_factory=list)
    last: list[float] = dataclasses.field(default_factory=list)
    acks: list[AckSeen] = dataclasses.field(default_factory=list)
    missed: int = 0
    incomplete: int = 0
    version: str | None = None

    def add(self, seen: Mapping[int, AckSeen | None], *, since: float) -> bool:
        """Count one change whose clients' ACKs are `seen`, timed from `since`; False if
        no client saw a new version (a miss)."""
        got = [ack for ack in seen.values() if ack is not None]
        if not got:
            self.missed += 1
            return False
        self.incomplete += len(got) < len(seen)
        self.first.append(min(ack.acked for ack in got) - since)
        self.last.append(max(ack.acked for ack in got) - since)
        self.acks.extend(got)
        self.version = max(got, key=lambda ack: ack.acked).version
        return True

    def result(self) -> _Pushes:
        return _Pushes(
            first=tuple(self.first),
            last=tuple(self.last),
            acks=tuple(self.acks),
            missed=self.missed,
            incomplete=self.incomplete,
            final_version=self.version,
        )


async def _metric_pushes(
    group: ClientGroup, pods: FakePods, probe: ServerProbe, spec: FleetSpec
) -> tuple[_Pushes, ServerReading, ServerReading]:
    before = await probe.read()
    tally = _Tally()
    for change in range(spec.changes):
        written = time.monotonic()
        pods.switch(0, BUSY if change % 2 == 0 else IDLE)
        scraped = await pods.wait_served(0, deadline=written + spec.push_bound_s)
        if scraped is None:
            logger.warning("Change %d: the pod was not scraped within the bound.", change)
            tally.missed += 1
            continue
        seen = await group.await_acks("eds", after=scraped, deadline=scraped + spec.push_bound_s)
        if not tally.add(seen, since=scraped):
            logger.warning("Change %d: no new EDS version within the bound.", change)
        await asyncio.sleep(max(0.0, written + spec.change_spacing_s - time.monotonic()))
    return tally.result(), before, await probe.read()


async def _config_pushes(
    group: ClientGroup, path: Path, documents: Sequence[str], spec: FleetSpec
) -> _Pushes:
    tally = _Tally()
    for change, text in enumerate(documents):
        written = _write_atomically(path, text)
        deadline = written + spec.config_poll_s + spec.config_bound_s
        seen = await group.await_acks("eds", after=written, deadline=deadline)
        if not tally.add(seen, since=written):
            logger.warning("Config change %d: no new EDS version within the bound.", change)
        await asyncio.sleep(max(0.0, written + spec.change_spacing_s - time.monotonic()))
    return tally.result()


async def _envoy_in_step(server: ServerProcess, version: str | None, *, within_s: float) -> bool:
    """Whether the real Envoy has ACKed EDS `version` (waiting up to `within_s`)."""
    if version is None:
        return False
    deadline = time.monotonic() + within_s
    while True:
        nodes = await server.get_json(f"/debug/nodes?node={ENVOY_NODE_ID}")
        for stream in nodes["streams"]:
            if (
                stream["node_id"] == ENVOY_NODE_ID
                and stream["acked_versions"].get("eds") == version
            ):
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(_PROBE_INTERVAL_S)


# -- one run -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Rig:
    """What a run measures with: the pods, the server and its probe, the clients, the
    config file and its versions (the first in force, then one per config change)."""

    pods: FakePods
    server: ServerProcess
    probe: ServerProbe
    group: ClientGroup
    path: Path
    documents: tuple[str, ...]
    envoy_live_s: float


async def _rig(stack: contextlib.AsyncExitStack, spec: FleetSpec) -> _Rig:
    """Start the pods, the server on their config, the real Envoy (until LIVE) and the
    client processes (until ready, streams not opened); `stack` stops them all."""
    layout = FleetLayout.of(spec)
    pods = await stack.enter_async_context(FakePods(spec.scraped_pods))
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-")))
    path = workdir / "config.yaml"
    documents = tuple(
        json.dumps(
            fleet_document(spec, layout, pod_ports=pods.ports, toggled_weight=weight),
            separators=(",", ":"),
        )
        for weight in (1, *itertools.islice(itertools.cycle((2, 1)), spec.config_changes))
    )
    RoutingConfig.model_validate_json(documents[0])  # refused here, not by the server
    _write_atomically(path, documents[0])
    logger.info(
        "Fleet: %d pools, %d endpoints (%d scraped); config %d bytes; starting the server.",
        spec.pools, spec.endpoints, spec.scraped_pods, len(documents[0]),
    )  # fmt: skip
    server = await stack.enter_async_context(
        ServerProcess(path, replica="fleet", extra_args=("--config-poll", str(spec.config_poll_s)))
    )
    probe = await stack.enter_async_context(ServerProbe(pid=server.pid, admin_url=server.admin_url))
    envoy_began = time.monotonic()
    bootstrap = render_bootstrap(
        xds_address="127.0.0.1",
        xds_port=server.xds_port,
        node_id=ENVOY_NODE_ID,
        node_cluster=NODE_CLUSTER,
        admin_port=0,
        delta=spec.delta,
    )
    envoy = await stack.enter_async_context(EnvoyProcess(bootstrap, log_level="error"))
    await envoy.wait_live(timeout=spec.connect_bound_s)
    envoy_live_s = time.monotonic() - envoy_began
    group = await stack.enter_async_context(
        ClientGroup(
            target=server.xds_address,
            clients=spec.clients,
            delta=spec.delta,
            node_cluster=NODE_CLUSTER,
            per_process=spec.clients_per_process,
        )
    )
    return _Rig(
        pods=pods,
        server=server,
        probe=probe,
        group=group,
        path=path,
        documents=documents,
        envoy_live_s=envoy_live_s,
    )


async def run_fleet(spec: FleetSpec) -> FleetResult:
    """Run every phase against a fresh server, pods, Envoy and clients; every process
    started is stopped (by its PID) before this returns or raises. Raises ValueError for
    a fleet that cannot be laid out (`FleetLayout.of`)."""
    started = time.monotonic()
    lag = _LagWatch()
    async with contextlib.AsyncExitStack() as stack:
        watch = asyncio.create_task(lag.run(), name="harness-lag")
        stack.push_async_callback(_cancelled, watch)
        rig = await _rig(stack, spec)
        group, probe = rig.group, rig.probe
        traffic = _Traffic()
        readings = {"start": await probe.read()}

        logger.info("Connect storm: %d %s clients.", spec.clients, spec.protocol)
        connected = await _connect(group, spec)
        readings["connected"] = await probe.read()
        traffic.add(await group.report())

        logger.info("Idle for %.0f s.", spec.idle_s)
        idle, readings["idle"] = await _idle(probe, spec)
        traffic.add(await group.report())

        logger.info("%d metrics changes.", spec.changes)
        pushes, readings["changes_from"], readings["changes"] = await _metric_pushes(
            group, rig.pods, probe, spec
        )
        traffic.add(await group.report())

        logger.info("%d config changes.", spec.config_changes)
        config = await _config_pushes(group, rig.path, rig.documents[1:], spec)
        readings["config_changes"] = await probe.read()
        config_types = traffic.add(await group.report())

        last_version = config.final_version or pushes.final_version
        in_step = await _envoy_in_step(rig.server, last_version, within_s=spec.push_bound_s)
        rss = rig.server.rss_bytes()
    return _result(
        spec,
        connected=connected,
        idle=idle,
        pushes=pushes,
        config=config,
        config_types=config_types,
        readings=readings,
        traffic=traffic,
        envoy_live_s=rig.envoy_live_s,
        in_step=in_step,
        rss_bytes=rss,
        harness_lag_max_s=lag.max_s,
        wall_s=time.monotonic() - started,
    )


def _result(
    spec: FleetSpec,
    *,
    connected: _Connected,
    idle: _Idle,
    pushes: _Pushes,
    config: _Pushes,
    config_types: set[str],
    readings: Mapping[str, ServerReading],
    traffic: _Traffic,
    envoy_live_s: float,
    in_step: bool,
    rss_bytes: int,
    harness_lag_max_s: float,
    wall_s: float,
) -> FleetResult:
    end = readings["config_changes"]
    seen = len(pushes.last)
    idle_rate = idle.cpu_s / idle.wall_s
    changes_from, changes_to = readings["changes_from"], readings["changes"]
    push_cpu_s = changes_to.cpu_s - changes_from.cpu_s
    push_wall_s = changes_to.at - changes_from.at
    phases = {
        "connect": stall_bound(readings["start"], readings["connected"]),
        "idle": stall_bound(readings["connected"], readings["idle"]),
        "changes": stall_bound(readings["changes_from"], readings["changes"]),
        "config_changes": stall_bound(readings["changes"], readings["config_changes"]),
    }
    stalls_start, stalls_end = readings["start"].stalls_over(0.05), end.stalls_over(0.05)
    return FleetResult(
        protocol=spec.protocol,
        flow_control=spec.flow_control,
        clients=spec.clients,
        clients_served=connected.clients_served,
        clients_disconnected=connected.disconnected,
        endpoints=spec.endpoints,
        pools=spec.pools,
        scraped_pods=spec.scraped_pods,
        scrape_interval_s=spec.scrape_interval_s,
        config_poll_s=spec.config_poll_s,
        debounce_s=UpdatesConfig().debounce_s,
        connect_all_s=connected.all_s,
        connect_p50_s=connected.p50_s,
        envoy_live_s=envoy_live_s,
        changes=spec.changes,
        missed_pushes=pushes.missed,
        incomplete_pushes=pushes.incomplete,
        change_to_first_ack_p50_s=percentile(pushes.first, 0.5),
        change_to_first_ack_p99_s=percentile(pushes.first, 0.99),
        change_to_last_ack_p50_s=percentile(pushes.last, 0.5),
        change_to_last_ack_p99_s=percentile(pushes.last, 0.99),
        config_changes=spec.config_changes,
        config_missed=config.missed,
        config_incomplete=config.incomplete,
        config_change_to_last_ack_p50_s=percentile(config.last, 0.5),
        config_change_to_last_ack_p99_s=percentile(config.last, 0.99),
        config_change_types=tuple(sorted(config_types)),
        cpu_s_per_push=push_cpu_s / seen if seen else None,
        cpu_s_per_push_over_idle=((push_cpu_s - idle_rate * push_wall_s) / seen if seen else None),
        idle_cpu_cores=idle.cpu_cores,
        loop_stall_max_s=stall_bound(readings["start"], end),
        loop_stall_max_s_by_phase=phases,
        loop_stalls_over_50ms=(
            None if stalls_start is None or stalls_end is None else stalls_end - stalls_start
        ),
        loop_lag_max_gauge_s=end.lag_max_s,
        rss_mb=rss_bytes / 1e6,
        sotw_eds_bytes_per_push=(
            statistics.fmean(a.bytes for a in pushes.acks) if pushes.acks else None
        ),
        eds_resources_per_push=(
            statistics.fmean(a.resources for a in pushes.acks) if pushes.acks else None
        ),
        signal_age_p99_s=percentile(idle.ages, 0.99),
        signal_age_max_s=max(idle.ages) if idle.ages else None,
        scraped_pods_per_core=(
            idle.scrapes / idle.cpu_s * spec.scrape_interval_s if idle.cpu_s > 0 else None
        ),
        idle_scrapes_per_s=idle.scrapes / idle.wall_s,
        nacks=round(end.nacks),
        envoy_in_step=in_step,
        responses_by_type=dict(sorted(traffic.responses.items())),
        received_mb_by_type={t: b / 1e6 for t, b in sorted(traffic.bytes.items())},
        harness_lag_max_s=harness_lag_max_s,
        wall_s=wall_s,
    )


# -- command line ------------------------------------------------------------------------


def _format(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        return " ".join(f"{k}={_format(v)}" for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) or "-"
    return str(value)


def _table(results: Sequence[FleetResult]) -> str:
    rows = [result.to_json() for result in results]
    width = max(len(key) for key in rows[0])
    lines = []
    for key in rows[0]:
        cells = "  ".join(f"{_format(row[key]):>14}" for row in rows)
        lines.append(f"{key:<{width}}  {cells}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    defaults = FleetSpec()
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--pools", type=int, default=defaults.pools)
    parser.add_argument("--endpoints", type=int, default=defaults.endpoints)
    parser.add_argument(
        "--clients", default=str(defaults.clients), help="ADS clients; a comma list sweeps"
    )
    parser.add_argument(
        "--protocol", default=None, help="sotw, delta or both (sotw,delta); default sotw"
    )
    parser.add_argument("--delta", action="store_true", help="the same as --protocol delta")
    parser.add_argument("--flow-control", action="store_true", help="flow_control.enabled")
    parser.add_argument("--scraped-pods", type=int, default=defaults.scraped_pods)
    parser.add_argument("--changes", type=int, default=defaults.changes)
    parser.add_argument("--config-changes", type=int, default=defaults.config_changes)
    parser.add_argument("--idle-s", type=float, default=defaults.idle_s)
    parser.add_argument("--scrape-interval", type=float, default=defaults.scrape_interval_s)
    parser.add_argument("--config-poll", type=float, default=defaults.config_poll_s)
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    return parser


def specs_of(args: argparse.Namespace) -> list[FleetSpec]:
    """One spec per combination of --clients and --protocol."""
    protocols = (args.protocol or ("delta" if args.delta else "sotw")).split(",")
    if not set(protocols) <= {"sotw", "delta"}:
        raise SystemExit(f"--protocol takes sotw and delta, not {args.protocol!r}")
    return [
        FleetSpec(
            pools=args.pools,
            endpoints=args.endpoints,
            clients=int(clients),
            scraped_pods=args.scraped_pods,
            flow_control=args.flow_control,
            delta=protocol == "delta",
            changes=args.changes,
            config_changes=args.config_changes,
            idle_s=args.idle_s,
            scrape_interval_s=args.scrape_interval,
            config_poll_s=args.config_poll,
        )
        for clients, protocol in itertools.product(args.clients.split(","), protocols)
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    specs = specs_of(args)
    for spec in specs:
        try:
            FleetLayout.of(spec)  # refuse a bad layout before anything starts
        except ValueError as exc:
            raise SystemExit(f"python -m bench.fleet: {exc}") from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    results = [asyncio.run(run_fleet(spec)) for spec in specs]
    documents = [result.to_json() for result in results]
    text = json.dumps(documents[0] if len(documents) == 1 else documents, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text if args.json else _table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
