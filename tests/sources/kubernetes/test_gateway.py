"""On Kubernetes, end to end: the real `kubernetes` client against the API server double,
this server, and a real Envoy whose endpoints (admin /clusters) follow the pods.

Pods are example backends on loopback addresses 127.0.0.2, 127.0.0.3, ... sharing one
port, the pool's target port, as pods share a container port behind distinct pod IPs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import yaml

from tests.e2e.conftest import chat, eventually, served_by
from tests.sources.kubernetes.apiserver import ApiServerDouble
from xds_server.settings import KubernetesSettings, WatchSettings
from xds_testbed.backends import ExampleBackend
from xds_testbed.gateway import LocalGateway, run_local_gateway

NAMESPACE = "ml"
CONFIGMAP = "xds-server-config"
FAST_WATCHES = WatchSettings(backoff_s=(0.05, 0.1, 0.2))


def config_document(**pool: Any) -> str:
    document = {
        "listener": {"address": "127.0.0.1", "port": 0},
        "updates": {"debounce_s": 0.02, "max_delay_s": 0.2},
        "pools": [
            {
                "name": "llama",
                "models": ["llama"],
                "gpu_aware": False,
                "selector": {"match_labels": {"app": "llama"}, "target_port": pool.pop("port")},
                **pool,
            }
        ],
    }
    return yaml.safe_dump(document)


def configmap(document: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIGMAP, "namespace": NAMESPACE},
        "data": {"config.yaml": document},
    }


def pod(
    name: str, ip: str, *, ready: bool = True, deleting: bool = False, app: str = "llama"
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "labels": {"app": app}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "server", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
async def pods() -> AsyncIterator[tuple[int, list[ExampleBackend]]]:
    """Three backends on 127.0.0.2-4, one port."""
    port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        backends = [
            await stack.enter_async_context(
                ExampleBackend(
                    backend_id=f"llama-{i}", models=("llama",), host=f"127.0.0.{i + 2}", port=port
                )
            )
            for i in range(3)
        ]
        yield port, backends


def seed(apiserver: ApiServerDouble, port: int, **pods: tuple[str, str]) -> None:
    """The ConfigMap selecting app=llama on `port`, and pods by name: (ip, app label)."""
    apiserver.put(configmap(config_document(port=port)))
    for name, (ip, app) in pods.items():
        apiserver.put(pod(name, ip, app=app))


@contextlib.asynccontextmanager
async def gateway_on(apiserver: ApiServerDouble) -> AsyncIterator[LocalGateway]:
    settings = KubernetesSettings(
        namespace=NAMESPACE,
        watch_namespaces=(NAMESPACE,),
        configmap=CONFIGMAP,
        api_host=apiserver.url,
        watch=FAST_WATCHES,
    )
    async with run_local_gateway(None, kubernetes=settings) as gateway:
        yield gateway


async def hosts(gateway: LocalGateway, cluster: str = "llama") -> dict[str, str]:
    """Envoy's view from admin /clusters: host address -> its EDS health."""
    for status in (await gateway.envoy.clusters_json()).get("cluster_statuses", []):
        if status["name"] == cluster:
            return {
                h["address"]["socket_address"]["address"]: h.get("health_status", {}).get(
                    "eds_health_status", "HEALTHY"
                )
                for h in status.get("host_statuses", [])
            }
    return {}


async def test_envoy_follows_pods_through_their_lifecycle(  # type: ignore[no-untyped-def]
    apiserver: ApiServerDouble, pods
) -> None:
    port, (a, b, c) = pods
    seed(apiserver, port, a=(a.host, "llama"), b=(b.host, "llama"), other=(c.host, "other"))
    async with gateway_on(apiserver) as gateway, aiohttp.ClientSession() as http:
        url = gateway.url
        assert await hosts(gateway) == {a.host: "HEALTHY", b.host: "HEALTHY"}
        assert set(await served_by(http, url, "llama", 40)) == {"llama-0", "llama-1"}

        # A new Ready pod joins; one turning unready leaves; it comes back when Ready.
        apiserver.put(pod("c", c.host))
        await eventually(lambda: _has(gateway, {a.host, b.host, c.host}), what="pod c to join")
        apiserver.put(pod("b", b.host, ready=False))
        await eventually(lambda: _has(gateway, {a.host, c.host}), what="unready b to leave")
        assert set(await served_by(http, url, "llama", 40)) == {"llama-0", "llama-2"}
        apiserver.put(pod("b", b.host))
        await eventually(lambda: _has(gateway, {a.host, b.host, c.host}), what="b to return")

        # A terminating pod drains: what it serves finishes, it gets nothing new, then goes.
        b.hold = asyncio.Event()
        b.token_delay = 0.01
        streams = [asyncio.create_task(_stream(http, url)) for _ in range(12)]
        await eventually(lambda: b.streams_started > 0, what="a stream on pod b")
        apiserver.put(pod("b", b.host, deleting=True))
        await eventually(
            lambda: _health_of(gateway, b.host, "DRAINING"), what="pod b to be DRAINING"
        )
        started_on_b = b.streams_started
        background = asyncio.create_task(served_by(http, url, "llama", 60))
        b.hold.set()
        results = await asyncio.gather(*streams)
        assert all(status == 200 and body.endswith(b"data: [DONE]") for status, body in results)
        assert "llama-1" not in await background
        assert b.streams_started == started_on_b
        apiserver.delete("Pod", NAMESPACE, "b")
        await eventually(lambda: _has(gateway, {a.host, c.host}), what="deleted b to leave")


async def test_expired_and_compacted_watches_lose_and_duplicate_nothing(  # type: ignore[no-untyped-def]
    apiserver: ApiServerDouble, pods
) -> None:
    port, (a, b, c) = pods
    seed(apiserver, port, a=(a.host, "llama"), b=(b.host, "llama"))
    async with gateway_on(apiserver) as gateway:
        # The watch ends (server timeout): it resumes from its resourceVersion.
        apiserver.expire_watches()
        apiserver.put(pod("c", c.host))
        await eventually(lambda: _has(gateway, {a.host, b.host, c.host}), what="c after expiry")
        # An outage: the watches fail; changes made meanwhile are found when they resume
        # (replayed from the watch's version, or by a relist, depending on the retry).
        await apiserver.stop()
        apiserver.delete("Pod", NAMESPACE, "a")
        apiserver.put(pod("a2", a.host))
        apiserver.delete("Pod", NAMESPACE, "c")
        await apiserver.start()
        await eventually(lambda: _has(gateway, {a.host, b.host}), what="the relisted pods")
        expired = _relists(gateway, "expired")
        # History compacted past the pod watch's version (a change it does not select moved
        # the server on): its next watch gets 410 Expired, and it lists again.
        apiserver.put(pod("x", c.host, app="other"))
        apiserver.compact()
        apiserver.expire_watches()
        await eventually(
            lambda: _relists(gateway, "expired") > expired, what="a relist after 410"
        )
        apiserver.put(pod("c", c.host))
        await eventually(lambda: _has(gateway, {a.host, b.host, c.host}), what="c after 410")
        config = gateway.app.controller.config
        assert config is not None
        assert [(e.address, e.port) for e in config.pools[0].endpoints] == [
            (a.host, port),
            (b.host, port),
            (c.host, port),
        ]


def _relists(gateway: LocalGateway, reason: str) -> float:
    value = gateway.app.telemetry.registry.get_sample_value(
        "xds_kubernetes_relists_total", {"resource": "pods", "reason": reason}
    )
    return value or 0.0


async def test_configmap_changes_apply_and_bad_ones_are_refused_with_an_event(  # type: ignore[no-untyped-def]
    apiserver: ApiServerDouble, pods
) -> None:
    port, (a, b, _) = pods
    seed(apiserver, port, a=(a.host, "llama"), b=(b.host, "llama"))
    async with gateway_on(apiserver) as gateway, aiohttp.ClientSession() as http:
        assert (await chat(http, gateway.url, "llama"))[0] == 200
        apiserver.put(configmap(config_document(port=port, models=["llama", "llama-2"])))
        await eventually(
            lambda: _chat_ok(http, gateway.url, "llama-2"), within_s=20, what="the new model"
        )

        apiserver.put(configmap("pools: [{name: Not_Valid}]"))
        await eventually(
            lambda: any(e["reason"] == "InvalidConfig" for e in apiserver.events(NAMESPACE)),
            what="a Warning Event on the ConfigMap",
        )
        (event,) = [e for e in apiserver.events(NAMESPACE) if e["reason"] == "InvalidConfig"]
        assert event["type"] == "Warning"
        assert event["involvedObject"]["kind"] == "ConfigMap"
        assert event["involvedObject"]["name"] == CONFIGMAP
        assert "pools.0.name" in event["message"]
        assert "pools.0.name" in (gateway.app.controller.last_error or "")
        errors = gateway.app.telemetry.registry.get_sample_value(
            "xds_config_reloads_total", {"result": "error"}
        )
        assert errors == 1
        # The last good config stays in force.
        assert await _chat_ok(http, gateway.url, "llama-2")


async def test_inference_pool_and_model_rewrite_drive_pools_and_splits(  # type: ignore[no-untyped-def]
    apiserver: ApiServerDouble, pods
) -> None:
    port, (a, b, _) = pods
    seed(apiserver, port, a=(a.host, "llama"), q=(b.host, "qwen"))
    async with gateway_on(apiserver) as gateway, aiohttp.ClientSession() as http:
        assert (await chat(http, gateway.url, "qwen3"))[0] == 404
        apiserver.put(
            {
                "apiVersion": "inference.networking.k8s.io/v1",
                "kind": "InferencePool",
                "metadata": {
                    "name": "qwen",
                    "namespace": NAMESPACE,
                    "annotations": {"xds-server.io/models": "qwen3"},
                },
                "spec": {
                    "selector": {"matchLabels": {"app": "qwen"}},
                    "targetPorts": [{"number": port}],
                    "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
                },
            }
        )
        await eventually(lambda: _chat_ok(http, gateway.url, "qwen3"), what="the qwen pool")
        assert await hosts(gateway, "qwen") == {b.host: "HEALTHY"}

        apiserver.put(
            {
                "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                "kind": "InferenceModelRewrite",
                "metadata": {"name": "chat-canary", "namespace": NAMESPACE},
                "spec": {
                    "poolRef": {"name": "llama"},
                    "rules": [
                        {
                            "matches": [{"model": {"value": "chat"}}],
                            "targets": [
                                {"modelRewrite": "llama", "weight": 75},
                                {"modelRewrite": "qwen3", "weight": 25},
                            ],
                        }
                    ],
                },
            }
        )
        await eventually(lambda: _chat_ok(http, gateway.url, "chat"), what="the chat split")
        tally = await served_by(http, gateway.url, "chat", 400)
        assert abs(tally.get("llama-1", 0) / 400 - 0.25) <= 0.06, tally
        assert set(tally) == {"llama-0", "llama-1"}, tally


async def test_two_replicas_build_identical_snapshots(  # type: ignore[no-untyped-def]
    apiserver: ApiServerDouble, pods
) -> None:
    port, (a, b, c) = pods
    seed(apiserver, port, c=(c.host, "llama"), a=(a.host, "llama"), b=(b.host, "llama"))
    async with gateway_on(apiserver) as one, gateway_on(apiserver) as two:
        for gateway in (one, two):
            await eventually(lambda g=gateway: _has(g, {a.host, b.host, c.host}), what="3 pods")
        first, second = one.app.controller.snapshot, two.app.controller.snapshot
        assert first is not None and second is not None
        assert first.versions == second.versions


async def _has(gateway: LocalGateway, addresses: set[str]) -> bool:
    return set(await hosts(gateway)) == addresses


async def _health_of(gateway: LocalGateway, address: str, health: str) -> bool:
    return (await hosts(gateway)).get(address) == health


async def _chat_ok(http: aiohttp.ClientSession, url: str, model: str) -> bool:
    return (await chat(http, url, model))[0] == 200


async def _stream(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    body = {"model": "llama", "messages": [], "stream": True}
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        return response.status, (await response.read()).rstrip()
