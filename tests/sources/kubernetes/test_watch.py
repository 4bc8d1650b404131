"""`ResourceWatcher` with the real `kubernetes` client against the API server double: list,
watch, resume, relist, bookmarks, absent kinds, cancellation and outages; and the client
setup it relies on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from tests.sources.kubernetes.apiserver import ApiServerDouble, RecordedRequest, flag
from xds_server.errors import XdsServerError
from xds_server.sources.kubernetes.client import (
    KubernetesError,
    api_client,
    kubernetes_error,
    own_namespace,
)
from xds_server.sources.kubernetes.watch import ResourceKind, ResourceWatcher
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

LOGGER = "xds_server.sources.kubernetes.watch"
PODS = ResourceKind(group="", version="v1", plural="pods", namespace="default")
POOLS = ResourceKind(
    group="inference.networking.k8s.io", version="v1", plural="inferencepools", namespace="default"
)
FAST = {"backoff_s": (0.05, 0.1, 0.2), "absent_retry_s": 0.1}


def pod(name: str, *, namespace: str = "default", phase: str = "Running", **labels: str) -> Any:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "status": {"phase": phase, "podIP": "10.0.0.1"},
    }


def configmap(name: str, value: str) -> Any:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default"},
        "data": {"v": value},
    }


async def eventually(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("The condition never became true.")
        await asyncio.sleep(0.01)


class Harness:
    """A watcher on the double, with its change count and metrics."""

    def __init__(self, api: ApiServerDouble, kind: ResourceKind, **options: Any) -> None:
        self.api = api
        self.changes = 0
        self.registry = CollectorRegistry()
        self.client = api_client(host=api.url)
        self.watcher = ResourceWatcher(
            self.client,
            kind,
            on_change=self._changed,
            telemetry=KubernetesTelemetry(self.registry),
            **{**FAST, **options},
        )
        self.task: asyncio.Task[None] | None = None

    def _changed(self) -> None:
        self.changes += 1

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def lists(self) -> list[RecordedRequest]:
        return [r for r in self.api.requests if r.method == "GET" and not r.is_watch]

    def watches(self) -> list[RecordedRequest]:
        return [r for r in self.api.requests if r.is_watch]

    def matches_server(self, kind: str = "Pod", namespace: str | None = "default") -> bool:
        server = {
            f"{o['metadata']['namespace']}/{o['metadata']['name']}": o
            for o in self.api.objects(kind, namespace)
        }
        return dict(self.watcher.objects) == server


@contextlib.asynccontextmanager
async def watching(
    api: ApiServerDouble, kind: ResourceKind = PODS, *, synced: bool = True, **options: Any
) -> AsyncIterator[Harness]:
    harness = Harness(api, kind, **options)
    harness.task = asyncio.create_task(harness.watcher.run())
    try:
        if synced:
            await harness.watcher.wait_synced(3)
        yield harness
    finally:
        harness.task.cancel()
        await asyncio.gather(harness.task, return_exceptions=True)
        harness.client.close()


async def test_lists_then_follows_additions_changes_and_deletions(
    apiserver: ApiServerDouble,
) -> None:
    apiserver.put(pod("a"))
    apiserver.put(pod("b"))
    async with watching(apiserver) as h:
        assert set(h.watcher.objects) == {"default/a", "default/b"}
        assert h.watcher.synced and not h.watcher.absent
        assert h.changes == 1
        assert h.matches_server()  # list items got their kind and apiVersion back
        assert h.watcher.objects["default/a"]["kind"] == "Pod"
        with pytest.raises(TypeError):
            h.watcher.objects["default/c"] = {}  # type: ignore[index]
        apiserver.put(pod("c"))
        apiserver.put(pod("a", phase="Failed"))
        apiserver.delete("Pod", "default", "b")
        await eventually(lambda: h.changes == 4)
        assert h.matches_server()
        assert h.watcher.objects["default/a"]["status"]["phase"] == "Failed"
        assert h.watcher.resource_version == str(apiserver.resource_version)
        assert h.metric("xds_kubernetes_objects", resource="pods") == 2
        assert h.metric("xds_kubernetes_relists_total", resource="pods", reason="initial") == 1
        for event_type in ("ADDED", "MODIFIED", "DELETED"):
            assert (
                h.metric("xds_kubernetes_watch_events_total", resource="pods", type=event_type) == 1
            )
        [watch] = h.watches()
        assert flag(watch.query["allowWatchBookmarks"])
        assert watch.query["timeoutSeconds"] == "300"


async def test_an_ended_stream_resumes_from_the_last_version_without_a_relist(
    apiserver: ApiServerDouble,
) -> None:
    apiserver.put(pod("a"))
    async with watching(apiserver) as h:
        await eventually(lambda: len(h.watches()) == 1)
        apiserver.put(pod("b"))
        await eventually(lambda: "default/b" in h.watcher.objects)
        seen = h.watcher.resource_version
        apiserver.expire_watches()
        apiserver.put(pod("c"))  # while the watcher reconnects: replayed from the history
        await eventually(lambda: "default/c" in h.watcher.objects)
        await eventually(lambda: len(h.watches()) == 2)
        assert len(h.lists()) == 1
        assert h.watches()[1].query["resourceVersion"] == seen
        assert h.matches_server()
        # each object was added exactly once: nothing replayed twice
        assert h.metric("xds_kubernetes_watch_events_total", resource="pods", type="ADDED") == 2
        assert h.changes == 3


async def test_an_expired_version_relists_and_drops_what_was_deleted_in_the_gap(
    apiserver: ApiServerDouble, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    apiserver.put(pod("a"))
    apiserver.put(pod("b"))
    async with watching(apiserver) as h:
        before = h.watcher.resource_version
        await eventually(lambda: len(h.watches()) == 1)
        # No await: the open stream ends before it delivers any of these.
        apiserver.delete("Pod", "default", "b")
        apiserver.put(pod("c"))
        apiserver.put(pod("a", phase="Failed"))
        apiserver.compact()
        apiserver.expire_watches()
        await eventually(lambda: len(h.lists()) == 2)
        await eventually(h.matches_server)
        assert set(h.watcher.objects) == {"default/a", "default/c"}
        assert h.watcher.objects["default/a"]["status"]["phase"] == "Failed"
        # resumed from where it was, was told 410, listed again, watched from the list
        assert h.watches()[1].query["resourceVersion"] == before
        await eventually(lambda: len(h.watches()) == 3)
        assert h.watches()[2].query["resourceVersion"] == str(apiserver.resource_version)
        assert h.metric("xds_kubernetes_relists_total", resource="pods", reason="expired") == 1
        assert h.metric("xds_kubernetes_watch_errors_total", resource="pods") == 0
        assert "too old resource version" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_bookmarks_keep_a_quiet_watcher_resumable_after_compaction(
    apiserver: ApiServerDouble,
) -> None:
    apiserver.put(pod("a"))
    async with watching(apiserver) as h:
        listed_at = h.watcher.resource_version
        for i in range(5):  # other kinds move the global version on
            apiserver.put(configmap("noise", str(i)))
        latest = str(apiserver.resource_version)
        assert listed_at != latest
        await eventually(lambda: h.watcher.resource_version == latest)  # a BOOKMARK
        assert h.changes == 1
        apiserver.compact()
        apiserver.expire_watches()
        await eventually(lambda: len(h.watches()) == 2)
        await asyncio.sleep(0.1)
        assert h.watches()[1].query["resourceVersion"] == latest
        assert len(h.lists()) == 1  # without the bookmark: 410, and a relist
        assert h.metric("xds_kubernetes_relists_total", resource="pods", reason="expired") == 0
        assert h.metric("xds_kubernetes_watch_events_total", resource="pods", type="BOOKMARK") > 0


async def test_streams_cut_short_again_and_again_do_not_make_a_busy_loop(
    apiserver: ApiServerDouble,
) -> None:
    async with watching(apiserver) as h:
        await eventually(lambda: len(h.watches()) == 1)
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.6
        while loop.time() < until:  # every stream ends within 10 ms, before any bookmark
            apiserver.expire_watches()
            await asyncio.sleep(0.01)
        # paused 0.05, 0.1, 0.2, 0.2 ... s between them, not one every 10 ms
        assert 3 <= len(h.watches()) <= 7
        assert len(h.lists()) == 1  # and each resumed from its version: no relist
        assert h.metric("xds_kubernetes_watch_errors_total", resource="pods") == 0
        with pytest.raises(RuntimeError, match="already running"):
            await h.watcher.run()


async def test_selectors_filter_and_an_object_that_stops_matching_leaves(
    apiserver: ApiServerDouble,
) -> None:
    apiserver.put(pod("a", app="vllm"))
    apiserver.put(pod("b", app="tgi"))
    apiserver.put(pod("c", app="vllm", namespace="other"))
    kind = ResourceKind(
        group="", version="v1", plural="pods", namespace="default", label_selector="app=vllm"
    )
    async with watching(apiserver, kind) as h:
        assert set(h.watcher.objects) == {"default/a"}
        apiserver.put(pod("b", app="vllm"))
        apiserver.put(pod("a", app="sglang"))
        apiserver.put(pod("d", app="tgi"))
        await eventually(lambda: set(h.watcher.objects) == {"default/b"})
        assert h.lists()[0].query["labelSelector"] == "app=vllm"
        assert h.watches()[0].query["labelSelector"] == "app=vllm"
    everywhere = ResourceKind(
        group="", version="v1", plural="pods", namespace="", field_selector="metadata.name=c"
    )
    async with watching(apiserver, everywhere) as h:
        assert set(h.watcher.objects) == {"other/c"}
        assert h.lists()[-1].path == "/api/v1/pods"


async def test_custom_objects_are_plain_dicts_like_core_ones(apiserver: ApiServerDouble) -> None:
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPorts": [{"number": 8}]},
    }
    apiserver.put(pool)
    async with watching(apiserver, POOLS) as h:
        assert h.watcher.objects["default/llama"]["spec"]["targetPorts"] == [{"number": 8}]
        apiserver.put({**pool, "metadata": {"name": "mistral", "namespace": "default"}})
        await eventually(lambda: len(h.watcher.objects) == 2)
        assert h.matches_server("InferencePool")
        resource = "inferencepools.inference.networking.k8s.io"
        assert h.metric("xds_kubernetes_objects", resource=resource) == 2


async def test_an_absent_crd_is_retried_until_it_is_installed(
    apiserver: ApiServerDouble, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    apiserver.installed_groups.discard(POOLS.group)
    async with watching(apiserver, POOLS, synced=False) as h:
        await h.watcher.wait_synced(3, or_absent=True)
        assert h.watcher.absent and not h.watcher.synced and not h.watcher.objects
        with pytest.raises(TimeoutError):
            await h.watcher.wait_synced(0.05)
        await eventually(lambda: len(h.lists()) >= 3)  # asked again every absent_retry_s
        assert not h.task.done()  # type: ignore[union-attr]
        apiserver.installed_groups.add(POOLS.group)
        apiserver.put(
            {
                "apiVersion": "inference.networking.k8s.io/v1",
                "kind": "InferencePool",
                "metadata": {"name": "llama"},
                "spec": {},
            }
        )
        await h.watcher.wait_synced(3)
        assert not h.watcher.absent
        await eventually(lambda: "default/llama" in h.watcher.objects)
        # a CRD removed later: its objects go, and the watcher waits for it again
        apiserver.installed_groups.discard(POOLS.group)
        apiserver.expire_watches()
        await eventually(lambda: h.watcher.absent)
        assert not h.watcher.objects and not h.watcher.synced
    assert "does not serve inferencepools" in caplog.text
    assert "serves inferencepools.inference.networking.k8s.io in namespace" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_cancellation_ends_run_and_its_threads_promptly(apiserver: ApiServerDouble) -> None:
    apiserver.put(pod("a"))
    async with watching(apiserver) as h:
        await eventually(lambda: len(h.watches()) == 1)
        await asyncio.sleep(0.1)  # the watch thread is blocked in a read
        assert any(t.name == "watch-pods" for t in threading.enumerate())
        assert h.task is not None
        started = time.monotonic()
        h.task.cancel()
        await asyncio.gather(h.task, return_exceptions=True)
        assert time.monotonic() - started < 5.0
    await eventually(
        lambda: not any(t.name in ("watch-pods", "list-pods") for t in threading.enumerate()),
        timeout_s=1.0,
    )


async def test_an_outage_backs_off_then_relists_when_the_server_is_back(
    apiserver: ApiServerDouble, caplog: pytest.LogCaptureFixture
) -> None:
    apiserver.put(pod("a"))
    caplog.set_level(logging.DEBUG, LOGGER)
    async with watching(apiserver) as h:
        await apiserver.stop()
        apiserver.delete("Pod", "default", "a")
        apiserver.put(pod("b"))
        await eventually(
            lambda: h.metric("xds_kubernetes_watch_errors_total", resource="pods") >= 4
        )
        assert set(h.watcher.objects) == {"default/a"}  # the last known set stays in use
        assert h.watcher.synced
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        message = warnings[0].getMessage()
        assert "pods in namespace 'default'" in message
        assert "could not be reached" in message and "retrying in 0.05 s" in message
        await apiserver.start()
        await eventually(h.matches_server)
        assert set(h.watcher.objects) == {"default/b"}
        assert h.metric("xds_kubernetes_relists_total", resource="pods", reason="error") >= 1
        await eventually(lambda: "works again after" in caplog.text)


async def test_backoff_follows_the_ladder_and_its_last_rung_repeats(
    apiserver: ApiServerDouble,
) -> None:
    await apiserver.stop()
    harness = Harness(apiserver, PODS, backoff_s=(0.1, 0.3))
    try:
        started = time.monotonic()
        await harness.watcher.run(_iterations=4)
        elapsed = time.monotonic() - started
    finally:
        harness.client.close()
    assert 0.1 + 0.3 + 0.3 + 0.3 <= elapsed < 2.0
    assert harness.metric("xds_kubernetes_watch_errors_total", resource="pods") == 4
    assert not harness.watcher.synced


async def test_a_raising_callback_is_logged_once_and_watching_goes_on(
    apiserver: ApiServerDouble, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("boom")

    client = api_client(host=apiserver.url)
    watcher = ResourceWatcher(client, PODS, on_change=broken)
    task = asyncio.create_task(watcher.run())
    try:
        await watcher.wait_synced(3)
        apiserver.put(pod("a"))
        apiserver.put(pod("b"))
        await eventually(lambda: len(watcher.objects) == 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        client.close()
    assert len(calls) == 3
    assert caplog.text.count("The on_change callback for pods") == 1


def test_resource_kind_names_what_it_watches() -> None:
    kind = ResourceKind(
        group="", version="v1", plural="pods", namespace="ml", label_selector="app=x"
    )
    assert str(kind) == "pods in namespace 'ml' (selected by app=x)"
    assert str(POOLS) == "inferencepools.inference.networking.k8s.io in namespace 'default'"
    assert POOLS.api_version == "inference.networking.k8s.io/v1" and kind.api_version == "v1"
    with pytest.raises(ValueError, match="core kinds"):
        ResourceKind(group="", version="v1", plural="nodes", namespace="")
    with pytest.raises(ValueError, match="backoff_s"):
        ResourceWatcher(kubernetes.client.ApiClient(), kind, on_change=lambda: None, backoff_s=())


# -- the client ----------------------------------------------------------------------------


def test_errors_are_translated_with_their_status() -> None:
    body = '{"kind": "Status", "reason": "NotFound", "message": "nope", "code": 404}'
    api_error = ApiException(status=404, reason="Not Found")
    api_error.body = body
    error = kubernetes_error(api_error, doing="Listing pods")
    assert isinstance(error, XdsServerError)
    assert (error.status, error.reason) == (404, "NotFound")
    assert str(error) == "Listing pods failed with HTTP 404: nope"
    gone = kubernetes_error(ApiException(status=410, reason="Gone"), doing="Watching pods")
    assert gone.status == 410 and "Gone" in str(gone)
    refused = urllib3.exceptions.MaxRetryError(
        None,  # type: ignore[arg-type]
        "/api/v1/pods",
        urllib3.exceptions.NewConnectionError(None, "Connection refused"),  # type: ignore[arg-type]
    )
    error = kubernetes_error(refused, doing="Listing pods")
    assert error.status is None
    assert str(error).startswith("Listing pods failed: the API server could not be reached")
    assert "NewConnectionError" in str(error)


def test_api_client_for_an_explicit_host_a_kubeconfig_or_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with api_client(host="http://127.0.0.1:8001/") as client:
        assert client.configuration.host == "http://127.0.0.1:8001"
        assert client.configuration.retries is False  # the watch loop retries, alone
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # an explicit kubeconfig wins
    with api_client(kubeconfig=kubeconfig) as client:
        assert client.configuration.host == "http://127.0.0.1:6443"
    with pytest.raises(KubernetesError, match="Cannot read the Kubernetes kubeconfig"):
        api_client(kubeconfig=tmp_path / "missing")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")  # but no service account files here
    with pytest.raises(KubernetesError, match="in-cluster"):
        api_client()


def test_own_namespace_comes_from_the_service_account(tmp_path: Path) -> None:
    path = tmp_path / "namespace"
    assert own_namespace(path=path) == "default"
    path.write_text("ml\n")
    assert own_namespace(path=path) == "ml"
