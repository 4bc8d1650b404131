"""Failover across clusters (issue 38, parts 1-2): two "clusters" on this machine, each a
server, a real Envoy (xDS over mutual TLS) and two simulated pods; the servers peer over
the same mutual TLS and tell each other their pools. Under a steady load on cluster A's
gateway, every pod of A is killed: requests move to B at once (none fails: Envoy retries
on the remote priority), A's server fails its pool over within the bound, and B's server
sees A's pool down and sends A nothing. A's pods come back: the traffic returns to them
in steps, second by second, and never more than their batch at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.profiles import H100
from tests.e2e.conftest import eventually
from xds_server.app import XdsApplication
from xds_server.config import RoutingConfig
from xds_server.envoy import names
from xds_server.envoy.bootstrap import BootstrapTls, render_bootstrap, render_sds_files
from xds_server.settings import ServerSettings, TlsSettings
from xds_testbed.certs import CertificateAuthority
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.server_process import free_port

SERVER_NAME = "xds-server.test"
# A batch of 6 (vLLM's --max-num-seqs), declared to the server as the pool's batch_limit.
BATCH = 6
PROFILE = dataclasses.replace(H100, max_num_seqs=BATCH)
RATE_PER_S = 8.0
FAILOVER_BOUND_S = 5.0
FAILOVER = {"hold_s": 1.0, "ramp_s": 4.0, "step_s": 0.5}


@dataclass
class Cluster:
    name: str
    fleet: Fleet
    listener_port: int
    xds_port: int
    app: XdsApplication | None = None
    envoy: EnvoyProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"


@dataclass
class Load:
    """Open-loop chat requests at RATE_PER_S: (sent at, served by, status) each."""

    url: str
    sent: list[tuple[float, str | None, int]] = field(default_factory=list)

    async def one(self, http: aiohttp.ClientSession) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
        at = asyncio.get_running_loop().time()
        try:
            async with http.post(f"{self.url}/v1/chat/completions", json=body) as response:
                await response.read()
                self.sent.append((at, response.headers.get("x-backend-id"), response.status))
        except aiohttp.ClientError:
            self.sent.append((at, None, 0))

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        rng = random.Random(7)
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            task = asyncio.create_task(self.one(http))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(RATE_PER_S))
        await asyncio.gather(*tasks)

    def served(self, start: float, end: float) -> list[tuple[str | None, int]]:
        return [(pod, status) for t, pod, status in self.sent if start <= t < end]


def _config(cluster: Cluster, other: Cluster) -> dict[str, Any]:
    return {
        "listener": {"address": "127.0.0.1", "port": cluster.listener_port},
        "updates": {"debounce_s": 0.02},
        "balancing": {"scrape_interval_s": 0.1, "stale_after_s": 0.6, "smoothing": 1.0},
        "pools": [
            {
                "name": "gpu",
                "models": ["m"],
                "batch_limit": BATCH,
                "endpoints": [{"address": "127.0.0.1", "port": p.port} for p in cluster.fleet],
                "remotes": [
                    {
                        "name": other.name,
                        "address": "127.0.0.1",
                        "port": other.listener_port,
                        "peer": f"127.0.0.1:{other.xds_port}",
                    }
                ],
                "failover": FAILOVER,
            }
        ],
    }


@contextlib.asynccontextmanager
async def _clusters(tmp_path: Path) -> AsyncIterator[tuple[Cluster, Cluster]]:
    ca = CertificateAuthority()
    async with contextlib.AsyncExitStack() as stack:
        clusters = []
        for name in ("a", "b"):
            specs = [PodSpec(name=f"{name}-{i}", profile=PROFILE) for i in range(2)]
            fleet = Fleet(specs, model="m")
            await stack.enter_async_context(fleet)
            clusters.append(Cluster(name, fleet, free_port(), free_port()))
        a, b = clusters
        for cluster, other in ((a, b), (b, a)):
            root = tmp_path / cluster.name
            server = ca.issue(root / "server", dns=[SERVER_NAME])
            envoy_cert = ca.issue(root / "envoy", uris=[f"spiffe://test/envoy/{cluster.name}"])
            config = RoutingConfig.model_validate(_config(cluster, other))
            path = root / "config.json"
            path.write_text(config.model_dump_json())
            settings = ServerSettings(
                config_path=path,
                xds_port=cluster.xds_port,
                admin_port=0,
                config_poll_s=3600,
                replica=f"server-{cluster.name}",
                tls=TlsSettings(
                    cert=server.cert,
                    key=server.key,
                    client_ca=server.ca,
                    peer_server_name=SERVER_NAME,
                ),
            )
            cluster.app = await stack.enter_async_context(XdsApplication(settings))
            await cluster.app.wait_ready(within_s=20)
            tls = BootstrapTls(
                cert_dir=str(envoy_cert.directory),
                sds_dir=str(root / "sds"),
                server_name=SERVER_NAME,
            )
            (root / "sds").mkdir()
            for file, content in render_sds_files(tls).items():
                (root / "sds" / file).write_text(yaml.safe_dump(content))
            bootstrap = render_bootstrap(
                xds_address="127.0.0.1",
                xds_port=cluster.app.xds_port,
                node_id=f"envoy-{cluster.name}",
                node_cluster="gateway",
                admin_port=0,
                tls=tls,
            )
            cluster.envoy = await stack.enter_async_context(
                EnvoyProcess(bootstrap, log_level="warn")
            )
            await cluster.envoy.wait_live(timeout=30)
            assert await cluster.envoy.listener_port(names.LISTENER_NAME) == cluster.listener_port
        yield a, b


def _sample(cluster: Cluster, name: str, **labels: str) -> float | None:
    assert cluster.app is not None
    value = cluster.app.telemetry.registry.get_sample_value(name, labels)
    return None if value is None else float(value)


def _plan(cluster: Cluster) -> Any:
    assert cluster.app is not None
    return cluster.app.controller.decision.failover.get("gpu")


async def _remote_priority_hosts(cluster: Cluster) -> list[tuple[int, str]]:
    """(priority, EDS health) of every host of the pool's cluster in Envoy."""
    assert cluster.envoy is not None
    clusters = await cluster.envoy.clusters_json()
    for status in clusters.get("cluster_statuses", []):
        if status["name"] == "gpu":
            return [
                (int(h.get("priority", 0)), h.get("health_status", {}).get("eds_health_status", ""))
                for h in status.get("host_statuses", [])
            ]
    return []


@pytest.mark.slow
async def test_a_cluster_that_loses_its_pods_fails_over_and_ramps_back(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    async with _clusters(tmp_path) as (a, b):
        assert a.app is not None and b.app is not None
        # Peered over mTLS: each server has the other's summary of the pool, healthy.
        await eventually(
            lambda: _plan(a) is not None and _plan(a).usable and _plan(b).usable,
            within_s=20,
            what="both servers seeing the other's pool usable",
        )
        assert [p for p, _ in await _remote_priority_hosts(a)].count(1) == 1

        load = Load(a.url)
        stop = asyncio.Event()
        samples: list[tuple[float, int, int]] = []  # (time, running, waiting) of A's pods

        async def watch_a_pods() -> None:
            while not stop.is_set():
                for pod in a.fleet:
                    if pod.state.value == "open":
                        snapshot = pod.state_snapshot()
                        engine = snapshot.engine
                        samples.append((loop.time(), engine.num_running, engine.num_waiting))
                await asyncio.sleep(0.05)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            runner = asyncio.create_task(load.run(http, stop))
            watcher = asyncio.create_task(watch_a_pods())
            await asyncio.sleep(4)
            before = load.served(loop.time() - 2, loop.time())
            assert before and all(pod is not None and pod.startswith("a-") for pod, _ in before)

            # Every pod of A dies.
            killed_at = loop.time()
            for pod in a.fleet:
                await pod.kill()
            await eventually(
                lambda: _plan(a).share == 0 and _plan(a).active,
                within_s=FAILOVER_BOUND_S,
                what="A's server failing its pool over",
            )
            failover_s = loop.time() - killed_at

            async def envoy_on_b() -> bool:
                hosts = await _remote_priority_hosts(a)
                return all(h == "UNHEALTHY" for p, h in hosts if p == 0)

            await eventually(envoy_on_b, within_s=FAILOVER_BOUND_S, what="Envoy A holding P0 out")
            envoy_failover_s = loop.time() - killed_at
            # B's server hears that A's pool is down: A gets none of B's traffic.
            await eventually(
                lambda: not _plan(b).usable, within_s=5, what="B seeing A's pool down"
            )
            assert _sample(a, "xds_pool_failover_active", pool="gpu") == 1
            assert _sample(a, "xds_pool_remote_share_ratio", pool="gpu") == 1
            assert _sample(a, "xds_pool_failovers_total", pool="gpu") == 1
            assert _sample(a, "xds_remote_up", pool="gpu", remote="b") == 1
            assert _sample(b, "xds_remote_up", pool="gpu", remote="a") == 0
            async with http.get(f"http://127.0.0.1:{a.app.debug_port}/debug/nodes") as page:
                fleet = (await page.json())["fleet"]
            assert fleet["failover"]["gpu"]["share"] == 0
            assert [s["up"] for s in fleet["remote_servers"]] == [True]
            await asyncio.sleep(4)
            during = load.served(killed_at, loop.time())

            # A's pods come back.
            revived_at = loop.time()
            for pod in a.fleet:
                await pod.revive()
            shares: list[tuple[float, float]] = []

            async def back_home() -> bool:
                plan = _plan(a)
                shares.append((loop.time() - revived_at, plan.share))
                return bool(plan.share >= 1.0)

            await eventually(back_home, within_s=40, what="A's pool back to all local")
            ramp_up_s = loop.time() - revived_at
            ramp_end = loop.time()
            assert _sample(a, "xds_pool_failover_active", pool="gpu") == 0
            assert _sample(a, "xds_pool_remote_share_ratio", pool="gpu") == 0
            await asyncio.sleep(2)
            stop.set()
            await asyncio.gather(runner, watcher)

        during_ramp = [(r, w) for t, r, w in samples if revived_at <= t <= ramp_end]
        per_second = []
        for second in range(int(ramp_end - revived_at) + 2):
            start = revived_at + second
            window = load.served(start, start + 1)
            home = sum(1 for pod, _ in window if pod is not None and pod.startswith("a-"))
            per_second.append((second, home, len(window)))
        print(
            f"failover: server {failover_s:.2f} s, Envoy {envoy_failover_s:.2f} s;"
            f" ramp-up {ramp_up_s:.2f} s; A's share per second after revival {per_second};"
            f" most requests on one of A's pods in the ramp {max(r + w for r, w in during_ramp)}"
        )
        # No request failed, before or during the failover (retried on the remote priority).
        assert during and all(status == 200 for _, status in during), [
            (pod, status) for pod, status in during if status != 200
        ]
        assert all(pod is not None and pod.startswith("b-") for pod, _ in during)
        assert failover_s <= FAILOVER_BOUND_S
        # The way back is gradual: the share went through several steps (and may have
        # backed off where the pods filled up), and never back to nothing.
        steps = sorted({s for _, s in shares if 0 < s < 1})
        assert len(steps) >= 4, shares
        first = next(i for i, (_, s) in enumerate(shares) if s > 0)
        assert all(s > 0 for _, s in shares[first:]), shares
        assert ramp_up_s >= FAILOVER["hold_s"] + FAILOVER["ramp_s"] * 0.5
        # ... and never overloads A's pods: never more requests on a pod than its batch
        # holds (a request arrived between two engine steps waits for the next one, so
        # `waiting` alone is not overload: waiting beyond a full batch is).
        assert during_ramp and max(r + w for r, w in during_ramp) <= BATCH
        after = load.served(revived_at, loop.time())
        assert all(status == 200 for _, status in after)
