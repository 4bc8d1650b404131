"""Reaction time: from a pod's metrics changing to Envoy applying the new weight.

Two fake vLLM pods serve a metrics page whose queue the probe controls. Each trial flips
one pod between idle and queued, then polls Envoy's admin `/clusters` until that pod's
weight there has changed. The figure covers everything in between: the scrape interval
(the change waits for the next scrape), parsing, scoring, the controller's throttle, the
snapshot build, the EDS push and Envoy applying it. The target is
`scrape_interval_s + debounce_s + 100 ms`.

    python -m bench.reaction [--trials 40]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from xds_server.config import RoutingConfig
from xds_testbed.gateway import LocalGateway, run_local_gateway

__all__ = ["FakeVllmPod", "measure_reaction"]

_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.2
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0
"""


class FakeVllmPod:
    """A /metrics page with a settable queue length and KV size, on 127.0.0.1 and a free port.

    While `broken` is set the page answers 500, as a pod in trouble would.
    """

    def __init__(self) -> None:
        self.waiting = 0
        self.gpu_blocks = 5000
        self.broken = False
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.broken:
            return web.Response(status=500, text="engine dead")
        page = _PAGE.format(waiting=self.waiting, blocks=self.gpu_blocks)
        return web.Response(text=page, content_type="text/plain")

    @contextlib.asynccontextmanager
    async def serving(self, port: int = 0) -> AsyncIterator[FakeVllmPod]:
        """Serve on `port` (0: a free one) until the context ends: then the port is closed,
        as a killed pod's is."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        try:
            yield self
        finally:
            await self._runner.cleanup()


def _config(ports: list[int], *, interval_s: float, debounce_s: float) -> RoutingConfig:
    return RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "updates": {"debounce_s": debounce_s, "max_delay_s": 1.0},
            "balancing": {"scrape_interval_s": interval_s, "smoothing": 1.0},
            "pools": [
                {
                    "name": "probe",
                    "models": ["probe-model"],
                    "endpoints": [{"address": "127.0.0.1", "port": p} for p in ports],
                }
            ],
        }
    )


async def _envoy_weight(gateway: LocalGateway, port: int) -> int | None:
    clusters = await gateway.envoy.clusters_json()
    for status in clusters.get("cluster_statuses", []):
        if status["name"] != "probe":
            continue
        for host in status.get("host_statuses", []):
            if host["address"]["socket_address"]["port_value"] == port:
                return int(host.get("weight", 1))
    return None


async def _until_weight_changes(gateway: LocalGateway, port: int, before: int | None) -> None:
    # Envoy is another process: its admin API can only be polled.
    while await _envoy_weight(gateway, port) == before:  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def measure_reaction(
    *, trials: int, interval_s: float = 0.25, debounce_s: float = 0.1
) -> dict[str, Any]:
    """Run `trials` flips; returns p50/p99/max in seconds and the target bound."""
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(FakeVllmPod().serving()) for _ in range(2)]
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path = workdir / "config.yaml"
        config = _config([p.port for p in pods], interval_s=interval_s, debounce_s=debounce_s)
        path.write_text(config.model_dump_json())
        gateway = await stack.enter_async_context(run_local_gateway(path, config_poll_s=3600))
        target = pods[1]
        await asyncio.wait_for(_until_weight_changes(gateway, target.port, None), 10)
        samples = []
        for trial in range(trials):
            before = await _envoy_weight(gateway, target.port)
            await asyncio.sleep(interval_s * (trial % 4) / 4)  # start at varied scrape phases
            target.waiting = 0 if target.waiting else 4
            changed = time.monotonic()
            await asyncio.wait_for(_until_weight_changes(gateway, target.port, before), 10)
            samples.append(time.monotonic() - changed)
        samples.sort()
        return {
            "trials": trials,
            "reaction_p50_s": statistics.median(samples),
            "reaction_p99_s": samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))],
            "reaction_max_s": samples[-1],
            "target_s": interval_s + debounce_s + 0.1,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure_reaction(trials=args.trials)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
