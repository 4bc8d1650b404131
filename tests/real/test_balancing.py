"""GPU-aware balancing over real vLLM pods: LoRA adapters placed from the pods' own
`vllm:lora_requests_info` and followed, weights that follow a real queue, and a keyed
user moved off a loaded pod."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.e2e.conftest import eventually
from tests.e2e.gpu_pool import hosts
from tests.real.conftest import real_gateway
from tests.real.traffic import loaded, served_one
from tests.real.vllm_pods import VllmPod
from xds_server.metrics.engines import engine_adapter
from xds_testbed.gateway import LocalGateway


async def test_adapters_are_placed_on_pods_of_their_own_and_followed(
    pods: list[VllmPod], tmp_path: Path
) -> None:
    """One LoRA slot per pod (`--max-loras 1`, the pool's `adapter_slots: 1`): a and b
    each settle on a pod of their own, different ones, and the pod that serves an adapter
    lists it on its own page."""
    served: dict[str, list[int]] = {"a": [], "b": []}
    async with (
        real_gateway(pods, tmp_path, adapter_slots=1) as gateway,
        aiohttp.ClientSession() as http,
    ):
        await eventually(lambda: _all_weighted(gateway), within_s=20, what="pods weighted")
        for i in range(16):
            adapter = "ab"[i % 2]
            served[adapter].append(await served_one(gateway, http, pods, {"model": adapter}))
        pages = {}
        for pod in pods:
            async with http.get(f"{pod.url}/metrics") as response:
                pages[pod.port] = engine_adapter("vllm").parse(await response.text())
    settled = {adapter: set(ports[4:]) for adapter, ports in served.items()}
    assert all(len(ports) == 1 for ports in settled.values()), served
    assert settled["a"] != settled["b"], served
    for adapter, ports in settled.items():
        (port,) = ports
        assert pages[port].lora_recent[:1] == (adapter,), (adapter, pages[port])


async def test_weights_follow_a_real_queue(pods: list[VllmPod], tmp_path: Path) -> None:
    """A pod with 4 running and a dozen waiting (load sent to it directly) gets a smaller
    weight at Envoy than its idle peers, and its share back once the load ends."""
    busy = pods[0]
    async with real_gateway(pods, tmp_path) as gateway:
        await eventually(lambda: _all_weighted(gateway), within_s=20, what="pods weighted")
        async with loaded(busy):

            async def busy_lighter() -> bool:
                weights = {port: weight for port, (weight, _) in (await hosts(gateway)).items()}
                idle = min(w for port, w in weights.items() if port != busy.port)
                return weights[busy.port] * 2 <= idle

            await eventually(busy_lighter, within_s=30, what="the queued pod's weight halved")

        async def even() -> bool:
            weights = [weight for weight, _ in (await hosts(gateway)).values()]
            return min(weights) * 10 >= max(weights) * 8

        await eventually(even, within_s=30, what="weights even again")


async def test_a_keyed_user_moves_off_a_loaded_pod(pods: list[VllmPod], tmp_path: Path) -> None:
    """With session affinity, a user's requests stay on one pod; once that pod's batch is
    full and its queue grows, the user's next requests go to another pod."""
    async with (
        real_gateway(pods, tmp_path, session_affinity=True, batch_limit=4) as gateway,
        aiohttp.ClientSession() as http,
    ):
        await eventually(lambda: _all_weighted(gateway), within_s=20, what="pods weighted")
        body = {"user": "alice"}
        home = await served_one(gateway, http, pods, body)
        assert {await served_one(gateway, http, pods, body) for _ in range(4)} == {home}
        (home_pod,) = (pod for pod in pods if pod.port == home)
        async with loaded(home_pod):

            async def moved() -> bool:
                return await served_one(gateway, http, pods, body) != home

            await eventually(moved, within_s=20, what="alice's requests off her loaded home")


async def _all_weighted(gateway: LocalGateway) -> bool:
    """Every pod in Envoy's view and healthy."""
    view = await hosts(gateway)
    return len(view) == 3 and all(health == "HEALTHY" for _, health in view.values())
