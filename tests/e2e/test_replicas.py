"""Server replicas that agree: flow control over three real Envoys attached to two server
processes (one Envoy on replica A, two on replica B), which share their Envoys' load
(xds_server/peering). The pool admits 6 Standard requests at once over the whole fleet;
each Envoy enforces its own part, so at most 6 plus one floor per Envoy are ever admitted,
whichever replica each Envoy talks to, and still when replica A is killed and its Envoy
moves to B. Also: an Envoy's part follows its demand."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ConfigFile, eventually, peered_replicas
from xds_server.envoy import names
from xds_testbed.backends import ExampleBackend
from xds_testbed.bootstraps import failover_bootstrap
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.server_process import ServerProcess

_T = TypeVar("_T")

POOL_LIMIT = 6
ENVOYS = ("envoy-1", "envoy-2", "envoy-3")
FLOW_CONTROL = {
    "enabled": True,
    "default_pod_concurrency": POOL_LIMIT,
    "critical_headroom": 0,
}


class Traffic:
    """Long streamed requests held by the backend; counts what each band got."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self.admitted = {"standard": 0, "critical": 0}
        self.refusals: list[str | None] = []
        self.tasks: list[asyncio.Task[int]] = []

    def send(self, url: str, band: str) -> None:
        self.tasks.append(asyncio.create_task(self._one(url, band)))

    async def _one(self, url: str, band: str) -> int:
        body = {"model": "m", "messages": [], "stream": True}
        headers = {"x-gateway-inference-band": band}
        async with self.http.post(
            f"{url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status == 429:
                self.refusals.append(response.headers.get("retry-after"))
            elif response.status == 200:
                self.admitted[band] += 1
            await response.read()
            return response.status

    async def finish(self) -> list[int]:
        return list(await asyncio.gather(*self.tasks))


@contextlib.asynccontextmanager
async def _sampling(probe: Callable[[], _T]) -> AsyncIterator[list[_T]]:
    """Sample `probe()` every 50 ms while the block runs."""
    samples: list[_T] = []

    async def sample() -> None:
        while True:
            samples.append(probe())
            await asyncio.sleep(0.05)

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        task.cancel()
        samples.append(probe())


async def _fleet(server: ServerProcess) -> dict[str, Any]:
    nodes = await server.get_json("/debug/nodes")
    fleet: dict[str, Any] = nodes["fleet"]
    return fleet


async def _metric(server: ServerProcess, name: str, **labels: str) -> float | None:
    """The value of sample `name` with `labels` on `server`'s /metrics."""
    async with aiohttp.ClientSession() as http, http.get(f"{server.admin_url}/metrics") as page:
        text = await page.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


async def _agreed(server: ServerProcess) -> bool:
    """`server` counts the three Envoys, all with their load reports, and splits the
    Standard budget among them."""
    fleet = await _fleet(server)
    envoys = {e["node_id"]: e for e in fleet["envoys"]}
    if set(envoys) != set(ENVOYS) or not all(e["reports_load"] for e in envoys.values()):
        return False
    limits = [e["limits"].get("pool", {}).get("standard", 0) for e in envoys.values()]
    return sum(limits) == POOL_LIMIT and fleet["reserved"] == 0


@pytest.mark.slow
async def test_two_replicas_three_envoys_admit_within_the_pool_limit_and_survive_a_kill(
    config_file: ConfigFile,
) -> None:
    hold = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        )
        backend = await stack.enter_async_context(
            ExampleBackend(backend_id="pod", models=("m",), hold=hold, tokens=3)
        )
        config_file.write({"pool": (["m"], [(backend, 1)])}, flow_control=FLOW_CONTROL)
        (a, b), _, urls = await peered_replicas(
            stack, config_file.path, (("envoy-1", 0), ("envoy-2", 1), ("envoy-3", 1))
        )
        # Each replica hears of the other's Envoys, and splits the budget over all three.
        await eventually(lambda: _agreed(a), within_s=30, what="replica A to count 3 Envoys")
        await eventually(lambda: _agreed(b), within_s=30, what="replica B to count 3 Envoys")
        envoy_1 = {e["node_id"]: e for e in (await _fleet(a))["envoys"]}["envoy-1"]
        assert envoy_1["heard_from"] == "local"
        assert {e["node_id"]: e["heard_from"] for e in (await _fleet(b))["envoys"]} == {
            "envoy-1": "a",
            "envoy-2": "local",
            "envoy-3": "local",
        }

        # Same inputs, same versions: both replicas give each Envoy the same snapshot,
        # whichever replica it talks to (A builds Envoy 2's and 3's too).
        snapshots = [await server.get_json("/debug/snapshot") for server in (a, b)]
        assert snapshots[0] == snapshots[1]
        assert set(snapshots[0]["envoys"]["(default)"]) == set(ENVOYS)
        # Observable: B's peer, and the fleet it splits the budget over.
        assert await _metric(b, "xds_peer_up", peer=a.xds_address) == 1
        assert await _metric(b, "xds_fleet_envoys") == len(ENVOYS)
        assert await _metric(b, "xds_band_budget", pool="pool", band="standard") == POOL_LIMIT

        traffic = Traffic(http)
        bound = POOL_LIMIT + len(ENVOYS)
        with_critical = 0

        def standard_at_pods() -> int:
            return backend.streams_started - with_critical

        async with _sampling(standard_at_pods) as samples:
            for url in urls:
                for _ in range(8):
                    traffic.send(url, "standard")
            await eventually(
                lambda: len(traffic.refusals) + traffic.admitted["standard"] == 24,
                within_s=30,
                what="every Standard request admitted or refused",
            )
            assert traffic.admitted["standard"] <= bound
            assert all(r is not None and int(r) >= 1 for r in traffic.refusals)
            # Critical is still admitted, through every Envoy.
            for url in urls:
                traffic.send(url, "critical")
            with_critical = len(urls)
            await eventually(
                lambda: traffic.admitted["critical"] == len(urls), what="Critical admitted"
            )

            # Replica A dies: Envoy 1 moves to B, and the bound still holds while more
            # Standard requests keep coming through all three Envoys.
            await a.kill()
            moved = False
            loop = asyncio.get_running_loop()
            until = loop.time() + 30
            while loop.time() < until:
                for url in urls:
                    traffic.send(url, "standard")
                fleet = await _fleet(b)
                moved = {e["node_id"]: e["heard_from"] for e in fleet["envoys"]} == dict.fromkeys(
                    ENVOYS, "local"
                ) and all(e["reports_load"] for e in fleet["envoys"])
                if moved:
                    break
                await asyncio.sleep(0.2)
            assert moved, f"Envoy 1 did not reconnect (ADS and LRS) to replica B: {fleet}"
            assert await _metric(b, "xds_peer_up", peer=a.xds_address) == 0

        assert max(samples) <= bound, samples
        hold.set()
        statuses = await traffic.finish()
        assert set(statuses) <= {200, 429}
        assert statuses.count(200) == traffic.admitted["standard"] + traffic.admitted["critical"]


async def test_an_envoys_part_follows_its_demand(
    config_file: ConfigFile, http: aiohttp.ClientSession
) -> None:
    """All traffic through one of two Envoys gets the whole budget but the other's floor
    (2 places here, so that it is not mistaken for the default of 1)."""
    floor = 2
    hold = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        backend = await stack.enter_async_context(
            ExampleBackend(backend_id="pod", models=("m",), hold=hold, tokens=3)
        )
        config_file.write(
            {"pool": (["m"], [(backend, 1)])},
            flow_control={**FLOW_CONTROL, "envoy_floor": floor},
        )
        server = await stack.enter_async_context(ServerProcess(config_file.path, replica="a"))
        busy, idle = [
            await stack.enter_async_context(
                EnvoyProcess(failover_bootstrap(node_id, server, server), log_level="warn")
            )
            for node_id in ("busy", "idle")
        ]
        for envoy in (busy, idle):
            await envoy.wait_live(timeout=30)
        url = f"http://127.0.0.1:{await busy.listener_port(names.LISTENER_NAME)}"

        async def both_known() -> bool:
            envoys = (await _fleet(server))["envoys"]
            return len(envoys) == 2 and all(e["reports_load"] for e in envoys)

        await eventually(both_known, within_s=30, what="both Envoys reporting load")
        traffic = Traffic(http)
        async with _sampling(lambda: backend.streams_started) as samples:
            loop = asyncio.get_running_loop()
            until = loop.time() + 30
            # Keep ten requests knocking at the busy Envoy, retrying each refusal.
            while backend.streams_started < POOL_LIMIT - floor and loop.time() < until:
                pending = sum(not t.done() for t in traffic.tasks) - backend.streams_started
                for _ in range(max(0, 10 - pending)):
                    traffic.send(url, "standard")
                await asyncio.sleep(0.1)
        assert backend.streams_started == POOL_LIMIT - floor, (
            f"the busy Envoy got {backend.streams_started} places, not {POOL_LIMIT - floor}"
        )
        assert max(samples) <= POOL_LIMIT
        limits = {
            e["node_id"]: e["limits"]["pool"]["standard"] for e in (await _fleet(server))["envoys"]
        }
        assert limits == {"busy": POOL_LIMIT - floor, "idle": floor}
        hold.set()
        await traffic.finish()
