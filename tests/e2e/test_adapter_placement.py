"""LoRA adapters placed end to end: on pods with one adapter slot each, through a real
Envoy, each adapter settles on a pod of its own, and configured adapter slots are filled
before the first request."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.pod import BACKEND_ID_HEADER
from llm_sim.profiles import H100
from tests.e2e.conftest import eventually
from tests.e2e.gpu_pool import (
    fleet_config,
)
from xds_testbed.gateway import run_local_gateway


async def alternate_adapters(
    http: aiohttp.ClientSession,
    url: str,
    count: int,
    served: dict[str, list[str]],
    *,
    pause_s: float = 0.0,
) -> None:
    """`count` completions, adapters a and b in turn; each pod that served one is appended
    to `served[adapter]`."""
    for i in range(count):
        adapter = "ab"[i % 2]
        body = {"model": adapter, "prompt": "hello there", "max_tokens": 2}
        async with http.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            served[adapter].append(response.headers[BACKEND_ID_HEADER])
        await asyncio.sleep(pause_s)


async def test_lora_adapters_spread_from_a_cold_start_and_stay_put(tmp_path: Path) -> None:
    """Two pods with one LoRA slot each and two adapters: the first pod to serve an adapter
    must not be handed both (its single slot would make one wait behind the other); each
    adapter settles on its own pod and its requests keep landing there."""
    profile = dataclasses.replace(H100, max_loras=1)
    specs = [PodSpec(name=f"pod-{i}", profile=profile, adapters=("a", "b")) for i in range(2)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(tmp_path, fleet, {"scrape_interval_s": 0.05}, adapters=["a", "b"])
        served: dict[str, list[str]] = {"a": [], "b": []}
        async with (
            run_local_gateway(path, config_poll_s=3600) as gateway,
            aiohttp.ClientSession() as http,
        ):
            # A pause between requests: a scrape now and then, as in real traffic.
            await alternate_adapters(http, gateway.url, 40, served, pause_s=0.03)
        loads = sum(pod.state_snapshot().engine.adapter_loads for pod in fleet.pods)
    # After the first few requests (the placement follows the first scrapes), each adapter
    # has its pod, a different one, and the slots stop changing hands.
    settled = {adapter: set(pods[10:]) for adapter, pods in served.items()}
    assert all(len(pods) == 1 for pods in settled.values()), served
    assert settled["a"] != settled["b"], served
    assert loads <= 6, (loads, served)


async def test_with_adapter_slots_configured_adapters_are_placed_before_the_first_request(
    tmp_path: Path,
) -> None:
    """vLLM reports its LoRA slots only once it has served a LoRA request; with the pool's
    `adapter_slots`, the server places the adapters before any, one per pod here, so even
    the first requests of each adapter go to its own pod and no slot changes hands."""
    profile = dataclasses.replace(H100, max_loras=1)
    specs = [PodSpec(name=f"pod-{i}", profile=profile, adapters=("a", "b")) for i in range(2)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(
            tmp_path, fleet, {"scrape_interval_s": 0.05}, adapters=["a", "b"], adapter_slots=1
        )
        served: dict[str, list[str]] = {"a": [], "b": []}
        async with (
            run_local_gateway(path, config_poll_s=3600) as gateway,
            aiohttp.ClientSession() as http,
        ):

            async def advertised() -> dict[int, tuple[str, ...]]:
                """Envoy's EDS for the pool: port -> the adapters in its metadata."""
                dump = await gateway.envoy.config_dump(
                    resource="dynamic_endpoint_configs", include_eds="true"
                )
                return {
                    endpoint["endpoint"]["address"]["socket_address"]["port_value"]: tuple(
                        endpoint.get("metadata", {})
                        .get("filter_metadata", {})
                        .get("envoy.lb", {})
                        .get("lora", [])
                    )
                    for config in dump.get("configs", [])
                    if config["endpoint_config"]["cluster_name"] == "gpu"
                    for locality in config["endpoint_config"].get("endpoints", [])
                    for endpoint in locality.get("lb_endpoints", [])
                }

            async def one_adapter_per_pod() -> bool:
                return sorted((await advertised()).values()) == [("a",), ("b",)]

            await eventually(one_adapter_per_pod, what="Envoy to hold one adapter per pod")
            await alternate_adapters(http, gateway.url, 20, served)
        loads = sum(pod.state_snapshot().engine.adapter_loads for pod in fleet.pods)
    assert [len(set(pods)) for pods in served.values()] == [1, 1], served
    assert set(served["a"]) != set(served["b"]), served
    assert loads == 2, (loads, served)
