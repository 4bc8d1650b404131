"""Scenario f2's gateway: server replicas that share their Envoys' load, one Envoy on each,
and what is measured there beyond f's figures.

Each replica is its own `python -m xds_server run --replica NAME --peer ...` process
(testbed ServerProcess) on the same config file, peering with every other replica; each
Envoy has one replica as its xDS server and the next one as a TCP-health-checked backup
(`failover_bootstrap`). The run starts once every replica counts every Envoy with its load
reports, splits the idle pool's budget over them with nothing held back for an unseen
peer, has scraped every pod, and each Envoy enforces the limit its replica gives it
(`wait_until_agreed`).

**Admitted concurrency over the limit** (`AdmittedSampler`): every 100 ms, the requests
each Envoy has admitted and not finished, per band: the sum over the band's clusters (one
per lane) of Envoy's `upstream_rq_active`, the count its circuit breaker holds against the
band's `max_requests`, taken from every Envoy's admin at once. The pool limit is flow
control's: T = ceil(C × (1 − critical_headroom)) places for Standard and Sheddable
together, C being the pool's capacity (the sum of its pods' concurrency,
`flow_control.pod_concurrency` or `default_pod_concurrency`), plus every Critical request
in flight (Critical is never refused). So the excess at a sample is

    (Standard + Sheddable + Critical admitted) − (T + Critical admitted)
        = Standard + Sheddable admitted − T,

and `max_admitted_over_limit` is its largest value over the run (0 if never over). Each
replica computes the budgets from the same fleet-wide load, but an Envoy keeps a floor of
each band's budget and the replicas hear of each other's Envoys a little late, so the
target is at most one place per Envoy. The pods' own count of the requests they serve is
sampled beside it (`pods_in_flight_max`): the same requests, all bands, seen from the
other side.

That limit leaves out what Standard's budget takes from it: every Critical request in
flight (Standard may grow to T − Critical − Sheddable), so with Critical a fifth of twice
the capacity it is far from binding. `max_all_bands_over_limit` is the stricter view, every
band's admitted requests over T: the pods holding more than T. It is not a failure by
itself: a Critical request is admitted whatever the load, and the Standard requests
admitted before it cannot be taken back, so Critical arriving into a full pool takes the
total over T until requests finish; it shows how far.

`FleetRecorder` keeps every replica's `/debug/nodes` fleet view (budgets, each Envoy's
limits and demand) twice a second, to see after a run why a figure is what it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from llm_sim.fleet import Fleet
from xds_server.config import BANDS, Band, RoutingConfig
from xds_server.envoy import names
from xds_server.envoy.runtime import max_requests_key
from xds_testbed.bootstraps import failover_bootstrap
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.server_process import ServerProcess, free_port

__all__ = [
    "AdmittedSampler",
    "FleetRecorder",
    "REPLICAS_NOTES",
    "ReplicatedGateway",
    "pool_limit",
    "run_replicated_gateway",
    "wait_until_agreed",
]

_NON_CRITICAL: tuple[Band, ...] = ("standard", "sheddable")

# What f2's own figures mean, for results.json (`notes` of the scenario).
REPLICAS_NOTES: Mapping[str, str] = {
    "max_admitted_over_limit": (
        "The largest, over samples every 100 ms, of the Standard+Sheddable requests the"
        " Envoys have admitted and not finished (Envoy's upstream_rq_active, summed over each"
        " band's clusters and every Envoy) minus T = ceil(C x (1 - critical_headroom)), C the"
        " pool's capacity (the sum of its pods' concurrency); i.e. every admitted request"
        " minus (T + the Critical ones admitted). 0 if never over. Target: at most the number"
        " of Envoys (one floor place each)."
    ),
    "max_all_bands_over_limit": (
        "The same samples, every band's admitted requests minus T: the pods holding more than"
        " T. Critical is admitted whatever the load and admitted requests are not taken back,"
        " so Critical arriving into a full pool takes this over T until requests finish."
    ),
    "admitted_limit": "T above.",
    "pods_in_flight_max": "The most requests the simulated pods served at once (all bands).",
    "limits_over_budget_max": (
        "Per replica and band, the most its Envoys' limits summed to beyond the band's"
        " fleet-wide budget in its /debug/nodes view, sampled every 0.5 s."
    ),
    "split": "Each Envoy's share of the trace's requests (seeded draw per request) and outcome.",
}


@dataclass(frozen=True)
class ReplicatedGateway:
    """Running replicas and their Envoys: `envoys[i]` (node `node_ids[i]`, listener
    `urls[i]`) takes its config from `servers[i]`."""

    servers: tuple[ServerProcess, ...]
    envoys: tuple[EnvoyProcess, ...]
    node_ids: tuple[str, ...]
    urls: tuple[str, ...]


@contextlib.asynccontextmanager
async def run_replicated_gateway(
    config_path: Path,
    *,
    replicas: Sequence[str],
    node_prefix: str = "bench-envoy",
    start_timeout_s: float = 60.0,
) -> AsyncIterator[ReplicatedGateway]:
    """Start one server process per name of `replicas` on `config_path`, each peering with
    all the others, and one Envoy per replica (node `<node_prefix>-<replica>`, backed by the
    next replica); returns once every Envoy is LIVE with its listener bound. Everything
    started is stopped on exit, by its process."""
    ports = {name: free_port() for name in replicas}
    servers = tuple(
        ServerProcess(
            config_path,
            replica=name,
            xds_port=ports[name],
            peers=[f"127.0.0.1:{ports[other]}" for other in replicas if other != name],
        )
        for name in replicas
    )
    async with contextlib.AsyncExitStack() as stack:
        await asyncio.gather(*(stack.enter_async_context(s) for s in servers))
        node_ids = tuple(f"{node_prefix}-{name}" for name in replicas)
        envoys = []
        for i, (node_id, server) in enumerate(zip(node_ids, servers, strict=True)):
            backup = servers[(i + 1) % len(servers)]
            envoys.append(
                await stack.enter_async_context(
                    EnvoyProcess(failover_bootstrap(node_id, server, backup), log_level="warn")
                )
            )
        urls = []
        for envoy in envoys:
            await envoy.wait_live(timeout=start_timeout_s)
            urls.append(f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}")
        yield ReplicatedGateway(
            servers=servers, envoys=tuple(envoys), node_ids=node_ids, urls=tuple(urls)
        )


def pool_limit(config: RoutingConfig, pool: str) -> int:
    """Flow control's limit on `pool`'s Standard and Sheddable requests in flight together,
    at full capacity: ceil(C × (1 − critical_headroom)), C the sum of its pods'
    concurrency (module docstring)."""
    settings = config.flow_control
    [spec] = [p for p in config.pools if p.name == pool]
    capacity = sum(
        settings.pod_concurrency.get(e.hardware or "", settings.default_pod_concurrency)
        for e in spec.endpoints
        if not e.draining
    )
    return math.ceil(capacity * (1 - settings.critical_headroom))


async def _fleet_view(server: ServerProcess) -> dict[str, Any]:
    nodes = await server.get_json("/debug/nodes")
    fleet: dict[str, Any] = nodes["fleet"]
    return fleet


async def _scraped_pods(server: ServerProcess, pool: str) -> int:
    """Pods of `pool` whose metrics `server` has (an age on its /metrics)."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.get(f"{server.admin_url}/metrics") as response,
    ):
        text = await response.text()
    return len(re.findall(rf'^xds_pod_metrics_age_seconds\{{[^}}]*pool="{pool}"', text, re.M))


async def _agreed(
    gateway: ReplicatedGateway, *, config: RoutingConfig, pool: str, pods: int
) -> str | None:
    """None when the gateway is ready to measure (`wait_until_agreed`), else what is not."""
    [spec] = [p for p in config.pools if p.name == pool]
    standard_clusters = names.band_clusters(config, spec)["standard"]
    for server in gateway.servers:
        fleet = await _fleet_view(server)
        envoys = {e["node_id"]: e for e in fleet["envoys"]}
        if set(envoys) != set(gateway.node_ids):
            return f"replica {server.replica} counts Envoys {sorted(envoys)}"
        if not all(e["reports_load"] for e in envoys.values()):
            return f"replica {server.replica} lacks some Envoy's load reports"
        if fleet["reserved"]:
            return f"replica {server.replica} holds back {fleet['reserved']} for unseen peers"
        budget = fleet["budgets"].get(pool, {}).get("budget", {}).get("standard", 0)
        limits = {n: e["limits"].get(pool, {}).get("standard", 0) for n, e in envoys.items()}
        if sum(limits.values()) != budget:
            return f"replica {server.replica} splits {budget} as {limits}"
        if (scraped := await _scraped_pods(server, pool)) < pods:
            return f"replica {server.replica} has scraped {scraped} of {pods} pods"
    for node_id, envoy, server in zip(
        gateway.node_ids, gateway.envoys, gateway.servers, strict=True
    ):
        mine = {e["node_id"]: e for e in (await _fleet_view(server))["envoys"]}[node_id]
        want = mine["limits"][pool]["standard"]
        runtime = json.loads(await envoy.admin_get("/runtime"))
        entries = runtime.get("entries", {})
        # The band's lanes (one cluster each) share the Envoy's limit.
        held = [
            entries.get(max_requests_key(cluster), {}).get("final_value")
            for cluster in standard_clusters
        ]
        if None in held or sum(int(h) for h in held) != want:
            return (
                f"Envoy {node_id} enforces {held} on {standard_clusters},"
                f" its replica says {want} in all"
            )
    return None


async def wait_until_agreed(
    gateway: ReplicatedGateway,
    *,
    config: RoutingConfig,
    pool: str,
    pods: int,
    within_s: float = 60.0,
) -> None:
    """Wait until every replica counts every Envoy with its load reports, holds nothing back
    for an unseen peer, splits `pool`'s Standard budget exactly over the Envoys, and has
    scraped its `pods` pods, and until each Envoy enforces the Standard limit its replica
    gives it. Raises TimeoutError, saying what was still missing, after `within_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while (missing := await _agreed(gateway, config=config, pool=pool, pods=pods)) is not None:
        if loop.time() > deadline:
            raise TimeoutError(f"The replicas did not agree within {within_s} s: {missing}.")
        await asyncio.sleep(0.2)


@dataclass(frozen=True)
class AdmittedSample:
    """One sample: wall-clock time, requests admitted and not finished per band (summed
    over the Envoys, and per Envoy), and the requests the pods serve."""

    at_unix: float
    by_band: Mapping[Band, int]
    by_envoy: Mapping[str, Mapping[Band, int]]
    pods_in_flight: int

    @property
    def non_critical(self) -> int:
        return sum(self.by_band[b] for b in _NON_CRITICAL)

    @property
    def total(self) -> int:
        return sum(self.by_band.values())


class AdmittedSampler:
    """Samples admitted concurrency every `INTERVAL_S` while a run replays (module
    docstring). Mutable state: `samples`, appended by the running task."""

    INTERVAL_S = 0.1

    def __init__(
        self,
        envoys: Mapping[str, EnvoyProcess],
        fleet: Fleet,
        *,
        config: RoutingConfig,
        pool: str,
    ) -> None:
        self._envoys = envoys
        self._fleet = fleet
        [spec] = [p for p in config.pools if p.name == pool]
        clusters = names.band_clusters(config, spec)
        self._band_of = {
            f"cluster.{cluster}.upstream_rq_active": band
            for band, of_band in clusters.items()
            for cluster in of_band
        }
        self._filter = "^(" + "|".join(re.escape(stat) for stat in self._band_of) + ")$"
        self.limit = pool_limit(config, pool)
        self.samples: list[AdmittedSample] = []

    async def _active(self, envoy: EnvoyProcess) -> dict[Band, int]:
        stats = await envoy.get_stats(self._filter)
        by_band: dict[Band, int] = dict.fromkeys(BANDS, 0)
        for stat, value in stats.items():
            if (band := self._band_of.get(stat)) is not None:
                by_band[band] += value
        return by_band

    async def sample(self) -> AdmittedSample:
        """Every Envoy's admitted requests and the pods' count, all asked for at once."""
        at = time.time()
        pods = sum(pod.state_snapshot().in_flight for pod in self._fleet)
        nodes = list(self._envoys)
        per_envoy = await asyncio.gather(*(self._active(self._envoys[n]) for n in nodes))
        by_band = {band: sum(e[band] for e in per_envoy) for band in BANDS}
        return AdmittedSample(
            at_unix=at,
            by_band=by_band,
            by_envoy=dict(zip(nodes, per_envoy, strict=True)),
            pods_in_flight=pods,
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                started = time.monotonic()
                self.samples.append(await self.sample())
                await asyncio.sleep(max(0.0, self.INTERVAL_S - (time.monotonic() - started)))

        task = asyncio.create_task(loop(), name="admitted-sampler")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def figures(self, *, started_at_unix: float) -> dict[str, Any]:
        """For results.json: `max_admitted_over_limit` and what it is made of (times in
        seconds from the trace's start, `started_at_unix`)."""
        if not self.samples:
            return {"max_admitted_over_limit": None, "admitted_samples": 0}
        worst = max(self.samples, key=lambda s: s.non_critical)
        fullest = max(self.samples, key=lambda s: s.total)
        return {
            "max_admitted_over_limit": max(0, worst.non_critical - self.limit),
            "max_admitted_over_limit_at_s": worst.at_unix - started_at_unix,
            "admitted_limit": self.limit,
            "max_all_bands_over_limit": max(0, fullest.total - self.limit),
            "max_all_bands_over_limit_at": {
                "t_s": fullest.at_unix - started_at_unix,
                **fullest.by_band,
            },
            "admitted_max_by_band": {
                band: max(s.by_band[band] for s in self.samples) for band in BANDS
            },
            "admitted_non_critical_max": worst.non_critical,
            "admitted_over_limit_samples": sum(
                1 for s in self.samples if s.non_critical > self.limit
            ),
            "admitted_samples": len(self.samples),
            "pods_in_flight_max": max(s.pods_in_flight for s in self.samples),
        }

    def save(self, path: Path, *, started_at_unix: float) -> None:
        """Every sample as a JSON line, time from the trace's start."""
        with path.open("w", encoding="utf-8") as file:
            for s in self.samples:
                line = {
                    "t": round(s.at_unix - started_at_unix, 3),
                    "by_band": s.by_band,
                    "by_envoy": s.by_envoy,
                    "pods_in_flight": s.pods_in_flight,
                }
                file.write(json.dumps(line, sort_keys=True) + "\n")


class FleetRecorder:
    """Every replica's `/debug/nodes` fleet view every `INTERVAL_S`, kept as JSON lines
    (mutable state: `views`, appended by the running task)."""

    INTERVAL_S = 0.5

    def __init__(self, servers: Sequence[ServerProcess]) -> None:
        self._servers = servers
        self.views: list[tuple[float, str, dict[str, Any]]] = []

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async def record(server: ServerProcess) -> None:
            while True:
                at = time.time()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    self.views.append((at, server.replica, await _fleet_view(server)))
                await asyncio.sleep(self.INTERVAL_S)

        tasks = [asyncio.create_task(record(s)) for s in self._servers]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def figures(self, *, pool: str) -> dict[str, Any]:
        """Per replica and band, the most its Envoys' limits ever summed to beyond the
        band's fleet-wide budget (the floors, and the parts given from stale load)."""
        over: dict[str, dict[str, int]] = {}
        for _, replica, fleet in self.views:
            budget = fleet["budgets"].get(pool, {}).get("budget", {})
            mine = over.setdefault(replica, {})
            for band in _NON_CRITICAL:
                total = sum(e["limits"].get(pool, {}).get(band, 0) for e in fleet["envoys"])
                excess = total - budget.get(band, 0)
                mine[band] = max(mine.get(band, excess), excess)
        return {"limits_over_budget_max": over, "fleet_views": len(self.views)}

    def save(self, path: Path, *, started_at_unix: float) -> None:
        with path.open("w", encoding="utf-8") as file:
            for at, replica, fleet in self.views:
                line = {"t": round(at - started_at_unix, 3), "replica": replica, "fleet": fleet}
                file.write(json.dumps(line, sort_keys=True) + "\n")
