"""End-to-end fixtures: example backends, a routing config file, the server and a real Envoy."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from xds_server.envoy import names
from xds_testbed.backends import BACKEND_ID_HEADER, ExampleBackend
from xds_testbed.bootstraps import failover_bootstrap
from xds_testbed.envoy_process import EnvoyProcess
from xds_testbed.faults import FaultyServer
from xds_testbed.gateway import LocalGateway, run_local_gateway
from xds_testbed.server_process import ServerProcess, free_port

Endpoint = ExampleBackend | FaultyServer


class ConfigFile:
    """The routing config file the server follows; tests rewrite it to change routing."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(
        self,
        pools: Mapping[str, tuple[Iterable[str], Iterable[tuple[Endpoint, int]]]],
        *,
        listener_port: int = 0,
        debounce_s: float = 0.02,
        balancing: str = "least_request",
        gpu_aware: bool = False,
        model_rewrites: Iterable[Mapping[str, Any]] = (),
        adapters: Mapping[str, Iterable[str]] | None = None,
        flow_control: Mapping[str, Any] | None = None,
        session_affinity: Iterable[str] = (),
        upstream: Mapping[str, Any] | None = None,
        request_timeout_s: float = 0.0,
        listener: Mapping[str, Any] | None = None,
        allow_empty: Iterable[str] = (),
    ) -> None:
        """Write the pools; `gpu_aware` is off by default: these backends have no /metrics.
        `flow_control` and `upstream` are the config's sections (absent when None),
        `listener` more keys of its listener;
        `session_affinity` names the pools that have it, `allow_empty` those that say
        `allow_empty: true`. An endpoint is anything with a
        `host` and a `port` (an ExampleBackend, a FaultyServer)."""
        document: dict[str, Any] = {
            "model_rewrites": list(model_rewrites),
            "listener": {
                "address": "127.0.0.1",
                "port": listener_port,
                "request_timeout_s": request_timeout_s,
                **(listener or {}),
            },
            "updates": {"debounce_s": debounce_s, "max_delay_s": 0.2},
            "pools": [
                {
                    "name": name,
                    "balancing": balancing,
                    "gpu_aware": gpu_aware,
                    "models": list(models),
                    "adapters": list((adapters or {}).get(name, ())),
                    "session_affinity": name in set(session_affinity),
                    "endpoints": [
                        {"address": b.host, "port": b.port, "weight": w} for b, w in endpoints
                    ],
                    **({"allow_empty": True} if name in set(allow_empty) else {}),
                }
                for name, (models, endpoints) in pools.items()
            ],
        }
        if flow_control is not None:
            document["flow_control"] = dict(flow_control)
        if upstream is not None:
            document["upstream"] = dict(upstream)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(document))
        tmp.replace(self.path)


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., Any]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(backend_id: str, **kwargs: Any) -> ExampleBackend:
            return await stack.enter_async_context(ExampleBackend(backend_id=backend_id, **kwargs))

        yield start


@pytest.fixture
def config_file(tmp_path: Path) -> ConfigFile:
    return ConfigFile(tmp_path / "config.yaml")


@pytest.fixture
async def gateway_factory(config_file: ConfigFile) -> AsyncIterator[Callable[..., Any]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(*, delta: bool = False) -> LocalGateway:
            return await stack.enter_async_context(
                run_local_gateway(config_file.path, delta=delta, config_poll_s=0.05)
            )

        yield start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def chat(
    http: aiohttp.ClientSession, url: str, model: str | None, **extra: Any
) -> tuple[int, str | None, Any]:
    """POST a chat completion; returns (status, backend id, parsed JSON body)."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **extra}
    if model is not None:
        body["model"] = model
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        return (
            response.status,
            response.headers.get(BACKEND_ID_HEADER),
            await response.json(content_type=None),
        )


async def served_by(
    http: aiohttp.ClientSession, url: str, model: str, count: int
) -> dict[str, int]:
    """Send `count` requests (10 at a time) and count which backend answered each."""
    tally: dict[str, int] = {}
    semaphore = asyncio.Semaphore(10)

    async def one() -> None:
        async with semaphore:
            status, backend, _ = await chat(http, url, model)
            key = backend if status == 200 else f"HTTP {status}"
            tally[key or "?"] = tally.get(key or "?", 0) + 1

    await asyncio.gather(*(one() for _ in range(count)))
    return tally


async def eventually(
    predicate: Callable[[], Any], *, within_s: float = 10.0, what: str = "condition"
) -> Any:
    """Poll `predicate` (sync or async) until truthy; fail the test after `within_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def peered_replicas(
    stack: contextlib.AsyncExitStack, config: Path, envoys: Iterable[tuple[str, int]]
) -> tuple[tuple[ServerProcess, ServerProcess], list[EnvoyProcess], list[str]]:
    """Two server replicas of `config`, "a" and "b", peered with each other, and an Envoy
    per (node id, index of its replica) that fails over to the other replica: the
    replicas, the Envoys (live) and each Envoy's listener URL, all closed with `stack`."""
    port_a, port_b = free_port(), free_port()
    a = ServerProcess(config, replica="a", xds_port=port_a, peers=[f"127.0.0.1:{port_b}"])
    b = ServerProcess(config, replica="b", xds_port=port_b, peers=[f"127.0.0.1:{port_a}"])
    await asyncio.gather(stack.enter_async_context(a), stack.enter_async_context(b))
    replicas = (a, b)
    started = [
        await stack.enter_async_context(
            EnvoyProcess(
                failover_bootstrap(node_id, replicas[index], replicas[1 - index]),
                log_level="warn",
            )
        )
        for node_id, index in envoys
    ]
    urls = []
    for envoy in started:
        await envoy.wait_live(timeout=30)
        urls.append(f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}")
    return replicas, started, urls
