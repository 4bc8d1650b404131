"""`KubernetesPeers` with the real `kubernetes` client against the API server double: which
pods are peers, and when the set is announced.

Each announcement goes into a queue and the tests take them in order. The pods' events
reach the watcher in the order they were made, so "the next announcement is X" also shows
that the changes made before X announced nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.sources.kubernetes.apiserver import ApiServerDouble
from xds_server.peering.kubernetes_peers import KubernetesPeers
from xds_server.settings import WatchSettings
from xds_server.sources.kubernetes.client import api_client
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

NAMESPACE = "xds-server"
LABELS = {"app.kubernetes.io/name": "xds-server", "app.kubernetes.io/component": "control-plane"}
SELECTOR = "app.kubernetes.io/name=xds-server"
PORT = 18000
OWN_POD = "xds-server-a"
# Generous: CI is a busy two-core machine; a passing test does not wait for it.
WITHIN_S = 30.0


def server_pod(
    name: str,
    ip: str | None,
    *,
    ready: bool = True,
    phase: str = "Running",
    deleting: bool = False,
    namespace: str = NAMESPACE,
    labels: dict[str, str] = LABELS,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    # Running containers are ready: an unready pod is one whose readiness gate is not yet
    # met, so only the Ready condition tells it apart.
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "ContainersReady", "status": str(phase == "Running")},
            {"type": "Ready", "status": str(ready)},
        ],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


class Harness:
    """What a running KubernetesPeers announced, in order."""

    def __init__(self, announced: asyncio.Queue[frozenset[str]]) -> None:
        self.announced = announced

    async def next(self) -> frozenset[str]:
        return await asyncio.wait_for(self.announced.get(), WITHIN_S)


@contextlib.asynccontextmanager
async def watching(
    api: ApiServerDouble, *, registry: CollectorRegistry | None = None
) -> AsyncIterator[Harness]:
    announced: asyncio.Queue[frozenset[str]] = asyncio.Queue()
    client = api_client(host=api.url)
    peers = KubernetesPeers(
        client,
        namespace=NAMESPACE,
        selector=SELECTOR,
        port=PORT,
        own_pod=OWN_POD,
        on_peers=announced.put_nowait,
        telemetry=KubernetesTelemetry(registry or CollectorRegistry()),
        watch=WatchSettings(backoff_s=(0.05, 0.1, 0.2)),
    )
    task = asyncio.create_task(peers.run())
    try:
        yield Harness(announced)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        client.close()


async def eventually(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WITHIN_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("The condition never became true.")
        await asyncio.sleep(0.01)


async def test_the_first_list_announces_the_other_ready_replicas(
    apiserver: ApiServerDouble,
) -> None:
    for pod in (
        server_pod(OWN_POD, "10.0.0.1"),
        server_pod("xds-server-b", "10.0.0.2"),
        server_pod("xds-server-c", "fd00::3"),
        server_pod("unready", "10.0.0.4", ready=False),
        server_pod("starting", "10.0.0.5", phase="Pending", ready=False),
        server_pod("no-ip-yet", None),
        server_pod("stopping", "10.0.0.6", deleting=True),
        server_pod("finished", "10.0.0.7", phase="Succeeded"),
        server_pod("envoy", "10.0.0.8", labels={"app.kubernetes.io/name": "envoy"}),
        server_pod("elsewhere", "10.0.0.9", namespace="other"),
    ):
        apiserver.put(pod)
    async with watching(apiserver) as h:
        assert await h.next() == {"10.0.0.2:18000", "[fd00::3]:18000"}


async def test_no_peers_is_announced_too(apiserver: ApiServerDouble) -> None:
    """Alone (the only replica so far): the caller still learns that the set is known."""
    apiserver.put(server_pod(OWN_POD, "10.0.0.1"))
    async with watching(apiserver) as h:
        assert await h.next() == frozenset()


async def test_a_replica_turning_ready_and_unready_comes_and_goes(
    apiserver: ApiServerDouble,
) -> None:
    apiserver.put(server_pod("xds-server-b", "10.0.0.2"))
    async with watching(apiserver) as h:
        assert await h.next() == {"10.0.0.2:18000"}
        apiserver.put(server_pod("xds-server-c", None, phase="Pending", ready=False))
        apiserver.put(server_pod("xds-server-c", "10.0.0.3", ready=False))
        apiserver.put(server_pod("xds-server-c", "10.0.0.3"))
        assert await h.next() == {"10.0.0.2:18000", "10.0.0.3:18000"}
        apiserver.put(server_pod("xds-server-c", "10.0.0.3", ready=False))
        assert await h.next() == {"10.0.0.2:18000"}


async def test_a_stopping_or_deleted_replica_leaves(apiserver: ApiServerDouble) -> None:
    apiserver.put(server_pod("xds-server-b", "10.0.0.2"))
    apiserver.put(server_pod("xds-server-c", "10.0.0.3"))
    async with watching(apiserver) as h:
        assert await h.next() == {"10.0.0.2:18000", "10.0.0.3:18000"}
        # Still Ready through its preStop wait, but on its way out.
        apiserver.put(server_pod("xds-server-c", "10.0.0.3", deleting=True))
        assert await h.next() == {"10.0.0.2:18000"}
        apiserver.delete("Pod", NAMESPACE, "xds-server-c")  # already left: nothing to say
        apiserver.delete("Pod", NAMESPACE, "xds-server-b")
        assert await h.next() == frozenset()


async def test_its_own_pod_and_pods_of_other_labels_or_namespaces_change_nothing(
    apiserver: ApiServerDouble,
) -> None:
    async with watching(apiserver) as h:
        assert await h.next() == frozenset()
        apiserver.put(server_pod(OWN_POD, "10.0.0.1"))
        apiserver.put(server_pod(OWN_POD, "10.0.0.1", ready=False))
        apiserver.put(server_pod(OWN_POD, "10.0.0.1"))
        apiserver.put(server_pod("envoy", "10.0.0.8", labels={"app.kubernetes.io/name": "envoy"}))
        apiserver.put(server_pod("xds-server-x", "10.0.0.9", namespace="other"))
        apiserver.delete("Pod", NAMESPACE, OWN_POD)
        apiserver.put(server_pod("xds-server-b", "10.0.0.2"))
        assert await h.next() == {"10.0.0.2:18000"}


async def test_a_relist_with_the_same_peers_announces_nothing(apiserver: ApiServerDouble) -> None:
    registry = CollectorRegistry()
    apiserver.put(server_pod("xds-server-b", "10.0.0.2"))
    async with watching(apiserver, registry=registry) as h:
        assert await h.next() == {"10.0.0.2:18000"}
        await eventually(lambda: sum(r.is_watch for r in apiserver.requests) == 1)
        # No await in between: the watch resumes from a version older than the history, is
        # told 410, and lists again.
        apiserver.put(server_pod("envoy", "10.0.0.8", labels={"app.kubernetes.io/name": "envoy"}))
        apiserver.compact()
        apiserver.expire_watches()
        # Watched, told 410, listed, watching again: the list has been applied.
        await eventually(lambda: sum(r.is_watch for r in apiserver.requests) >= 3)
        relists = {"resource": "pods", "reason": "expired"}
        assert registry.get_sample_value("xds_kubernetes_relists_total", relists) == 1
        apiserver.put(server_pod("xds-server-c", "10.0.0.3"))
        assert await h.next() == {"10.0.0.2:18000", "10.0.0.3:18000"}


def test_an_empty_selector_or_namespace_is_refused() -> None:
    """An empty selector or namespace would make Envoys and model servers peers."""
    client = api_client(host="http://127.0.0.1:1")
    options: dict[str, Any] = {
        "port": PORT,
        "own_pod": OWN_POD,
        "on_peers": lambda peers: None,
        "telemetry": KubernetesTelemetry(CollectorRegistry()),
        "watch": WatchSettings(),
    }
    try:
        with pytest.raises(ValueError, match="namespace and a label selector"):
            KubernetesPeers(client, namespace=NAMESPACE, selector=" ", **options)
        with pytest.raises(ValueError, match="namespace and a label selector"):
            KubernetesPeers(client, namespace="", selector=SELECTOR, **options)
    finally:
        client.close()
