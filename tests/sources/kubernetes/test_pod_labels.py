"""Pods found on Kubernetes name themselves in the server's metrics as Prometheus names
them in their own series: xds_pod_* carry model_server_pod and model_server_namespace
(the pod's name and namespace), the hardware label and the endpoint; and their pool's
saturation counts them. The real `kubernetes` client against the API server double, and
simulated vLLM pods on 127.0.0.2 and 127.0.0.3 sharing one port, as pods share a
container port behind their own IPs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import yaml

from llm_sim.pod import SimulatedPod
from tests.e2e.conftest import eventually
from tests.sources.kubernetes.apiserver import ApiServerDouble
from tests.sources.kubernetes.test_gateway import (
    NAMESPACE,
    configmap,
    free_port,
    gateway_on,
    pod,
)
from xds_server.sources.kubernetes.inventory import HARDWARE_LABEL
from xds_testbed.gateway import LocalGateway


@contextlib.asynccontextmanager
async def simulated(port: int) -> AsyncIterator[list[SimulatedPod]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                SimulatedPod(f"llama-{i}", model="llama", host=f"127.0.0.{i + 2}", port=port)
            )
            for i in range(2)
        ]


def weights(gateway: LocalGateway) -> dict[tuple[str, ...], float]:
    """xds_pod_weight's samples by (endpoint, model_server_pod, namespace, hardware)."""
    return {
        (
            s.labels["endpoint"],
            s.labels["model_server_pod"],
            s.labels["model_server_namespace"],
            s.labels["hardware"],
        ): s.value
        for family in gateway.app.telemetry.registry.collect()
        for s in family.samples
        if s.name == "xds_pod_weight"
    }


async def test_discovered_pods_are_labelled_with_their_name_namespace_and_hardware(
    apiserver: ApiServerDouble,
) -> None:
    port = free_port()
    document = {
        "listener": {"address": "127.0.0.1", "port": 0},
        "updates": {"debounce_s": 0.02, "max_delay_s": 0.2},
        "balancing": {"scrape_interval_s": 0.1},
        "flow_control": {"pod_concurrency": {"h100": 8}},
        "pools": [
            {
                "name": "llama",
                "models": ["llama"],
                "selector": {"match_labels": {"app": "llama"}, "target_port": port},
            }
        ],
    }
    apiserver.put(configmap(yaml.safe_dump(document)))
    async with simulated(port) as pods:
        for i, sim in enumerate(pods):
            labelled = pod(sim.name, f"127.0.0.{i + 2}")
            labelled["metadata"]["labels"][HARDWARE_LABEL] = "h100"
            apiserver.put(labelled)
        async with gateway_on(apiserver) as gateway:
            expected = {
                (f"127.0.0.{i + 2}:{port}", sim.name, NAMESPACE, "h100")
                for i, sim in enumerate(pods)
            }
            await eventually(
                lambda: set(weights(gateway)) == expected, within_s=20, what="labelled pods"
            )
            registry = gateway.app.telemetry.registry
            capacity = registry.get_sample_value("xds_pool_capacity_requests", {"pool": "llama"})
            assert capacity == 2 * 8
            assert registry.get_sample_value("xds_pool_saturation_ratio", {"pool": "llama"}) == 0
