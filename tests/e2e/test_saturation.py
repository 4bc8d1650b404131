"""The autoscaling signal end to end: simulated pods behind a real Envoy, loaded through
it, and the server's /metrics. A pool sent more requests than its pods' nominal
concurrency reads a saturation above 1; a pool left idle reads 0 (flow control off: the
signal does not need it). The per-pod series carry the labels that join them with the
pods' own (endpoint, model_server_pod, hardware)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.profiles import H100
from tests.e2e.conftest import eventually
from xds_server.config import RoutingConfig
from xds_testbed.gateway import LocalGateway, run_local_gateway

pytestmark = pytest.mark.slow

SLOTS = 4  # nominal concurrency of a "sim" pod: the busy pool's capacity is 8
REQUESTS = 16  # in flight at once on the busy pool: saturation 2


def config_file(tmp_path: Path, busy: Fleet, idle: Fleet) -> Path:
    config = RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "updates": {"debounce_s": 0.02},
            "balancing": {"scrape_interval_s": 0.1},
            "flow_control": {"pod_concurrency": {"sim": SLOTS}, "default_pod_concurrency": 16},
            "pools": [
                {
                    "name": name,
                    "models": [name],
                    "endpoints": [
                        {"address": "127.0.0.1", "port": p.port, "name": p.name, "hardware": "sim"}
                        for p in fleet.pods
                    ],
                }
                for name, fleet in (("busy", busy), ("idle", idle))
            ],
        }
    )
    path = tmp_path / "config.yaml"
    path.write_text(config.model_dump_json())
    return path


async def samples(gateway: LocalGateway) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The server's /metrics, as Prometheus reads it: name -> [(labels, value)]."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gateway.app.admin_port}/metrics") as response:
            text = await response.text()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def of_pool(found: dict[str, list[tuple[dict[str, str], float]]], name: str, pool: str) -> float:
    (value,) = [v for labels, v in found.get(name, []) if labels["pool"] == pool] or [-1.0]
    return value


async def complete(http: aiohttp.ClientSession, url: str) -> int:
    body = {"model": "busy", "prompt": "tell me a long story", "max_tokens": 200}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        await response.read()
        return response.status


async def test_a_loaded_pool_reads_above_one_and_an_idle_pool_near_zero(tmp_path: Path) -> None:
    async with (
        Fleet([PodSpec(name=f"busy-{i}", profile=H100) for i in range(2)], model="busy") as busy,
        Fleet([PodSpec(name="idle-0", profile=H100)], model="idle") as idle,
        run_local_gateway(config_file(tmp_path, busy, idle), config_poll_s=3600) as gateway,
        aiohttp.ClientSession() as http,
    ):

        async def ratios() -> dict[str, float]:
            found = await samples(gateway)
            name = "xds_pool_saturation_ratio"
            return {pool: of_pool(found, name, pool) for pool in ("busy", "idle")}

        async def both_idle() -> bool:
            return all(0 <= r < 0.05 for r in (await ratios()).values())

        await eventually(both_idle, within_s=20, what="both pools weighed, idle")
        load = [asyncio.create_task(complete(http, gateway.url)) for _ in range(REQUESTS)]

        async def loaded() -> bool:
            r = await ratios()
            return r["busy"] > 1.5 and 0 <= r["idle"] < 0.05

        await eventually(loaded, within_s=20, what="busy above 1.5, idle near 0")
        found = await samples(gateway)
        assert of_pool(found, "xds_pool_capacity_requests", "busy") == 2 * SLOTS
        assert of_pool(found, "xds_pool_capacity_requests", "idle") == SLOTS
        assert of_pool(found, "xds_pool_demand_requests", "busy") > 1.5 * 2 * SLOTS
        # The pods' own series name them as their configured names and hardware class.
        running = [
            (labels["model_server_pod"], labels["hardware"], labels["endpoint"])
            for labels, _ in found["xds_pod_requests_running"]
            if labels["pool"] == "busy"
        ]
        assert sorted(running) == [(p.name, "sim", f"127.0.0.1:{p.port}") for p in busy.pods]

        assert await asyncio.gather(*load) == [200] * REQUESTS
        await eventually(both_idle, within_s=20, what="the busy pool back near 0")
