"""One GPU-aware pool `gpu` behind a real Envoy, as the GPU-aware end-to-end tests set it
up (over fake vLLM pods or a simulated fleet), and what they read back: Envoy's weights and
health per pod, and the server's xds_pod_* samples."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.reaction import FakeVllmPod
from llm_sim.fleet import Fleet
from xds_server.config import RoutingConfig
from xds_testbed.gateway import LocalGateway, run_local_gateway


@contextlib.asynccontextmanager
async def gateway_over(
    pods: list[FakeVllmPod], tmp_path: Path, **balancing: object
) -> AsyncIterator[LocalGateway]:
    config = RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "updates": {"debounce_s": 0.02},
            "balancing": {
                "scrape_interval_s": 0.1,
                "smoothing": 1.0,
                "stale_after_s": 0.6,
                **balancing,
            },
            "pools": [
                {
                    "name": "gpu",
                    "models": ["m"],
                    "endpoints": [{"address": "127.0.0.1", "port": p.port} for p in pods],
                }
            ],
        }
    )
    path = tmp_path / "config.yaml"
    path.write_text(config.model_dump_json())
    async with run_local_gateway(path, config_poll_s=3600) as gateway:
        yield gateway


async def hosts(gateway: LocalGateway) -> dict[int, tuple[int, str]]:
    """Envoy's view of the pool: port -> (weight, EDS health)."""
    clusters = await gateway.envoy.clusters_json()
    for status in clusters.get("cluster_statuses", []):
        if status["name"] == "gpu":
            return {
                h["address"]["socket_address"]["port_value"]: (
                    int(h.get("weight", 1)),
                    h.get("health_status", {}).get("eds_health_status", "HEALTHY"),
                )
                for h in status.get("host_statuses", [])
            }
    return {}


def fleet_config(
    tmp_path: Path,
    fleet: Fleet,
    balancing: dict[str, object],
    *,
    flow_control: dict[str, object] | None = None,
    **pool: object,
) -> Path:
    """A config file with one GPU-aware pool `gpu` (model `m`, plus `pool` keys) over the
    simulated `fleet`."""
    config = RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "updates": {"debounce_s": 0.02},
            "balancing": balancing,
            "flow_control": flow_control or {},
            "pools": [
                {
                    "name": "gpu",
                    "models": ["m"],
                    **pool,
                    "endpoints": [{"address": "127.0.0.1", "port": p.port} for p in fleet.pods],
                }
            ],
        }
    )
    path = tmp_path / "config.yaml"
    path.write_text(config.model_dump_json())
    return path


async def pod_samples(gateway: LocalGateway) -> dict[tuple[str, str], float]:
    """The server's xds_pod_* samples: (name, pod id) -> value."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gateway.app.admin_port}/metrics") as response:
            text = await response.text()
    return {
        (s.name, s.labels["endpoint"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("xds_pod_")
    }
