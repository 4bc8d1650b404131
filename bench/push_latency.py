"""How fast a change reaches Envoy, and what a push costs the server.

Two measurements, one run:

1. Push latency through a real Envoy: the routing config changes (an endpoint weight, so an
   EDS-only push; or a new model, so CDS+EDS+RDS), and the clock stops when Envoy's ACK of
   the new version arrives at the server. Debounce is set to 0 so the figure is the push path
   itself; with the default debounce (100 ms after the last change) add that. SotW and Delta.
2. CPU per push for 1,000 endpoints: building and serializing the snapshot from the config
   (the EDS-only path rebuilds only the ClusterLoadAssignments), and assembling one Envoy's
   response from the pre-serialized fragments (the per-Envoy cost).

    python bench/push_latency.py [--pushes 200] [--json]
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
from pathlib import Path
from typing import Any

import yaml

from xds_server.config import RoutingConfig
from xds_server.snapshot_builder import SnapshotBuilder
from xds_server.xds.resources import ResourceType
from xds_server.xds.sotw import SotwStream
from xds_server.xds.stream import Response
from xds_testbed.backends import ExampleBackend
from xds_testbed.gateway import LocalGateway, run_local_gateway

__all__ = ["main"]


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _config(ports: list[int], weights: list[int], models: list[str]) -> dict[str, Any]:
    return {
        "listener": {"address": "127.0.0.1", "port": 0},
        "updates": {"debounce_s": 0, "max_delay_s": 0},
        "pools": [
            {
                "name": "pool",
                "models": models,
                "endpoints": [
                    {"address": "127.0.0.1", "port": p, "weight": w}
                    for p, w in zip(ports, weights, strict=True)
                ],
            }
        ],
    }


async def _push(gateway: LocalGateway, document: dict[str, Any], type_name: str) -> float:
    controller = gateway.app.controller
    config = RoutingConfig.model_validate(document)
    started = time.perf_counter()
    gateway.app.submit_config(config)
    snapshot = await asyncio.wait_for(controller.settled(), 10)
    assert snapshot is not None
    resource_type = {t.short: t for t in ResourceType}[type_name]
    version = snapshot.versions[resource_type]
    await asyncio.wait_for(gateway.app.registry.wait_for_ack(type_name, version), 10)
    return time.perf_counter() - started


async def _latency(pushes: int, *, delta: bool) -> dict[str, dict[str, float]]:
    async with contextlib.AsyncExitStack() as stack:
        backends = [
            await stack.enter_async_context(ExampleBackend(backend_id=f"b{i}")) for i in range(4)
        ]
        ports = [b.port for b in backends]
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path = workdir / "config.yaml"
        path.write_text(yaml.safe_dump(_config(ports, [1, 1, 1, 1], ["m"])))
        gateway = await stack.enter_async_context(
            run_local_gateway(path, delta=delta, config_poll_s=3600)
        )
        results: dict[str, list[float]] = {"eds": [], "rds": []}
        for i in range(pushes):
            weights = [1 + (i % 7), 1, 1, 2 + (i % 3)]
            results["eds"].append(await _push(gateway, _config(ports, weights, ["m"]), "eds"))
        for i in range(max(10, pushes // 4)):
            models = ["m", f"model-{i}"]
            results["rds"].append(await _push(gateway, _config(ports, [1, 1, 1, 1], models), "rds"))
        return {
            kind: {
                "pushes": len(samples),
                "p50_ms": 1000 * statistics.median(samples),
                "p99_ms": 1000 * _percentile(samples, 0.99),
                "max_ms": 1000 * max(samples),
            }
            for kind, samples in results.items()
        }


class _NullObserver:
    def on_node(self, node: Any) -> None: ...
    def on_sent(self, response: Response) -> None: ...
    def on_ack(self, response: Response) -> None: ...
    def on_nack(self, response: Response, error: str) -> None: ...
    def on_stale_nonce(self, resource_type: ResourceType, nonce: str) -> None: ...
    def on_unknown_type(self, type_url: str) -> None: ...


def _cpu(endpoints: int, repeats: int) -> dict[str, float]:
    """CPU seconds per push: snapshot build (EDS-only path) and one Envoy's response assembly."""
    from envoy.service.discovery.v3 import discovery_pb2

    def config(weight: int) -> RoutingConfig:
        return RoutingConfig.model_validate(
            {
                "listener": {"address": "127.0.0.1", "port": 8080},
                "pools": [
                    {
                        "name": "pool",
                        "models": ["m"],
                        "endpoints": [
                            {"address": f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
                             "port": 8000, "weight": weight if i == 0 else 1}
                            for i in range(endpoints)
                        ],
                    }
                ],
            }
        )  # fmt: skip

    configs = [config(1 + i % 50) for i in range(repeats)]
    builder = SnapshotBuilder()
    builder.build(config(99))
    started = time.process_time()
    snapshots = [builder.build(c) for c in configs]
    build = (time.process_time() - started) / repeats

    request = discovery_pb2.DiscoveryRequest(
        type_url=ResourceType.ENDPOINT.url, resource_names=["pool"]
    )
    stream = SotwStream(stream_id=1, observer=_NullObserver())
    stream.set_snapshot(snapshots[0], born=0.0)
    [first] = stream.receive(request)
    started = time.process_time()
    payload_bytes = 0
    last = first
    for snapshot in snapshots[1:]:
        ack = discovery_pb2.DiscoveryRequest(
            type_url=ResourceType.ENDPOINT.url, resource_names=["pool"], response_nonce=last.nonce
        )
        stream.receive(ack)
        [last] = stream.set_snapshot(snapshot, born=0.0) or [last]
        payload_bytes = len(last.payload)
    assemble = (time.process_time() - started) / max(1, repeats - 1)
    return {
        "endpoints": endpoints,
        "build_and_serialize_ms": 1000 * build,
        "per_envoy_response_ms": 1000 * assemble,
        "eds_payload_bytes": payload_bytes,
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "cpu_per_push": _cpu(1000, args.cpu_repeats),
        "latency": {
            "sotw": await _latency(args.pushes, delta=False),
            "delta": await _latency(args.pushes, delta=True),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=200, help="EDS pushes per protocol")
    parser.add_argument("--cpu-repeats", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = asyncio.run(_main(args))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    cpu = results["cpu_per_push"]
    print(f"CPU per push, {cpu['endpoints']} endpoints (EDS-only change):")
    print(f"  build + serialize snapshot: {cpu['build_and_serialize_ms']:.2f} ms, once for all")
    print(
        f"  assemble one Envoy's response: {cpu['per_envoy_response_ms']:.3f} ms"
        f" ({cpu['eds_payload_bytes']} bytes)"
    )
    print("Push latency, config change -> Envoy ACK (debounce 0):")
    for protocol, kinds in results["latency"].items():
        for kind, figures in kinds.items():
            print(
                f"  {protocol:<5} {kind} x{figures['pushes']:<4} p50 {figures['p50_ms']:.1f} ms"
                f"  p99 {figures['p99_ms']:.1f} ms  max {figures['max_ms']:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
