"""The local demo: this server, a real Envoy and example model servers, on loopback.

It writes a routing config to a temporary file and prints where to send requests and which
file to edit: changes to the file reach Envoy within about a second, so weights, endpoints
and models can be tried live. Later issues replace the example backends with simulated GPU
pods and add the routing benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp
import yaml

from xds_server.local.backends import BACKEND_ID_HEADER, ExampleBackend
from xds_server.local.gateway import LocalGateway, run_local_gateway

__all__ = ["run_demo"]

_POOLS = {"llama": ("llama-3.1-8b", 2), "qwen": ("qwen3-32b", 1)}


def _demo_config(
    listener_port: int, backends: Mapping[str, Sequence[ExampleBackend]]
) -> dict[str, object]:
    return {
        "listener": {"address": "127.0.0.1", "port": listener_port},
        "pools": [
            {
                "name": pool,
                "models": [_POOLS[pool][0]],
                "endpoints": [
                    {"address": b.host, "port": b.port, "weight": 1} for b in pool_backends
                ],
            }
            for pool, pool_backends in backends.items()
        ],
    }


async def _self_check(gateway: LocalGateway) -> list[str]:
    """One request per model through Envoy; returns a line per request saying who answered."""
    lines = []
    async with aiohttp.ClientSession() as session:
        for model, _ in _POOLS.values():
            body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}]}
            async with session.post(f"{gateway.url}/v1/chat/completions", json=body) as response:
                await response.read()
                backend = response.headers.get(BACKEND_ID_HEADER)
                lines.append(f"  {model:<14} -> HTTP {response.status} from {backend}")
    return lines


async def run_demo(*, listener_port: int = 8080, duration_s: float | None = None) -> None:
    """Run until Ctrl-C (or for `duration_s` seconds)."""
    async with contextlib.AsyncExitStack() as stack:
        backends: dict[str, list[ExampleBackend]] = {}
        for pool, (model, count) in _POOLS.items():
            backends[pool] = [
                await stack.enter_async_context(
                    ExampleBackend(
                        backend_id=f"{pool}-{i}", models=[model], tokens=16, token_delay=0.05
                    )
                )
                for i in range(count)
            ]
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="xds-demo-")))
        config_path = workdir / "config.yaml"
        config_path.write_text(
            yaml.safe_dump(_demo_config(listener_port, backends), sort_keys=False)
        )
        gateway = await stack.enter_async_context(run_local_gateway(config_path))
        example = json.dumps(
            {
                "model": "llama-3.1-8b",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            }
        )
        print(
            "\n".join(
                [
                    "",
                    f"Envoy is routing OpenAI-style requests on {gateway.url} (models: "
                    + ", ".join(m for m, _ in _POOLS.values())
                    + ").",
                    "Self-check through Envoy:",
                    *await _self_check(gateway),
                    "",
                    "Try:",
                    f"  curl -N {gateway.url}/v1/chat/completions \\",
                    f"       -H 'content-type: application/json' -d '{example}'",
                    "",
                    f"Routing config (edit it; Envoy follows within a second): {config_path}",
                    f"xDS server admin:  http://127.0.0.1:{gateway.app.admin_port}"
                    "/debug/nodes  /debug/snapshot  /metrics",
                    f"Envoy admin:       {gateway.envoy.admin_url}/clusters  /stats",
                    "Press Ctrl-C to stop.",
                    "",
                ]
            ),
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), duration_s)
