"""The API server double, checked with the official `kubernetes` client (and raw HTTP where
the wire format itself is the point)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import kubernetes.client
import kubernetes.watch
import pytest
from kubernetes.client.exceptions import ApiException

from tests.sources.kubernetes.apiserver import ApiServerDouble, flag

POOLS = ("inference.networking.k8s.io", "v1", "default", "inferencepools")


def pod(name: str, *, namespace: str = "default", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "status": {"podIP": "10.0.0.1", "phase": "Running"},
    }


def pool(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": name}}, "targetPorts": [{"number": 8000}]},
    }


def watch_events(func: Callable[..., Any], *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Every event of one watch, until the server ends it (blocking: run it in a thread)."""
    return list(kubernetes.watch.Watch().stream(func, *args, **kwargs))


async def wait_for_watch(api: ApiServerDouble, count: int = 1) -> None:
    """Until `count` watch requests have reached the double."""
    for _ in range(200):
        if sum(r.is_watch for r in api.requests) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("The watch request never arrived.")


async def test_list_stamps_versions_and_filters_by_selectors(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    a = apiserver.put(pod("a", app="vllm", tier="gpu"))
    b = apiserver.put(pod("b", app="vllm"))
    apiserver.put(pod("c", app="tgi"))
    apiserver.put(pod("d", namespace="other", app="vllm"))
    assert int(b["metadata"]["resourceVersion"]) > int(a["metadata"]["resourceVersion"])
    assert a["metadata"]["uid"] and a["metadata"]["creationTimestamp"]
    core = kubernetes.client.CoreV1Api(kube_client)

    async def names(**kwargs: Any) -> list[str]:
        pods = await asyncio.to_thread(core.list_namespaced_pod, "default", **kwargs)
        return [p.metadata.name for p in pods.items]

    listed = await asyncio.to_thread(core.list_namespaced_pod, "default")
    assert listed.metadata.resource_version == str(apiserver.resource_version)
    assert listed.items[0].status.pod_ip == "10.0.0.1"
    assert await names() == ["a", "b", "c"]
    assert await names(label_selector="app=vllm") == ["a", "b"]
    assert await names(label_selector="app==vllm,tier") == ["a"]
    assert await names(label_selector="app!=vllm") == ["c"]
    assert await names(label_selector="!tier,app in (vllm, tgi)") == ["b", "c"]
    assert await names(label_selector="app notin (vllm)") == ["c"]
    assert await names(field_selector="metadata.name=b") == ["b"]
    everywhere = await asyncio.to_thread(core.list_pod_for_all_namespaces)
    assert [p.metadata.name for p in everywhere.items] == ["a", "b", "c", "d"]
    with pytest.raises(ApiException) as bad:
        await asyncio.to_thread(core.list_namespaced_pod, "default", label_selector="a=(")
    assert bad.value.status == 400


async def test_raw_list_is_the_apiserver_shape(apiserver: ApiServerDouble) -> None:
    apiserver.put(pod("a"))
    apiserver.put(pool("p"))
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{apiserver.url}/api/v1/namespaces/default/pods") as response:
            pods = await response.json()
        path = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
        async with http.get(apiserver.url + path) as response:
            pools = await response.json()
    assert pods["kind"] == "PodList" and pods["apiVersion"] == "v1"
    assert pods["metadata"]["resourceVersion"] == str(apiserver.resource_version)
    assert "kind" not in pods["items"][0]  # core list items carry no kind, as served
    assert pools["kind"] == "InferencePoolList"
    assert pools["items"][0]["kind"] == "InferencePool"  # custom objects do


async def test_get_one_and_missing_ones(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    apiserver.put(pod("a"))
    core = kubernetes.client.CoreV1Api(kube_client)
    got = await asyncio.to_thread(core.read_namespaced_pod, "a", "default")
    assert got.metadata.name == "a" and got.kind == "Pod"
    with pytest.raises(ApiException) as missing:
        await asyncio.to_thread(core.read_namespaced_pod, "b", "default")
    assert missing.value.status == 404
    assert json.loads(missing.value.body)["reason"] == "NotFound"


async def test_watch_replays_history_then_ends_at_its_timeout(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    start = apiserver.put(pod("a", app="x"))["metadata"]["resourceVersion"]
    apiserver.put(pod("b", app="x"))
    apiserver.put({**pod("a", app="x"), "status": {"phase": "Failed"}})
    apiserver.put(pod("other", namespace="elsewhere"))
    gone = apiserver.delete("Pod", "default", "b")
    core = kubernetes.client.CoreV1Api(kube_client)
    began = time.monotonic()
    events = await asyncio.to_thread(
        watch_events, core.list_namespaced_pod, "default", resource_version=start, timeout_seconds=1
    )
    assert 0.9 < time.monotonic() - began < 10
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "b"),
        ("MODIFIED", "a"),
        ("DELETED", "b"),
    ]
    assert events[1]["object"].status.phase == "Failed"
    assert (
        events[2]["raw_object"]["metadata"]["resourceVersion"]
        == gone["metadata"]["resourceVersion"]
    )
    versions = [int(e["raw_object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(start)


async def test_watch_without_version_starts_with_every_object_then_streams_live_changes(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    apiserver.put(pod("a", app="x"))
    apiserver.put(pod("b", app="y"))
    core = kubernetes.client.CoreV1Api(kube_client)
    watching = asyncio.create_task(
        asyncio.to_thread(
            watch_events,
            core.list_namespaced_pod,
            "default",
            label_selector="app=x",
            timeout_seconds=5,
        )
    )
    await wait_for_watch(apiserver)
    apiserver.put(pod("c", app="x"))
    apiserver.put(pod("b", app="x"))  # starts matching: ADDED
    apiserver.put(pod("a", app="z"))  # stops matching: DELETED
    apiserver.put(pod("d", app="y"))  # never matches
    await asyncio.sleep(0.2)
    apiserver.expire_watches()
    events = await asyncio.wait_for(watching, 3)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "a"),
        ("ADDED", "c"),
        ("ADDED", "b"),
        ("DELETED", "a"),
    ]


async def test_watch_stream_is_chunked_json_lines_with_bookmarks(
    apiserver: ApiServerDouble,
) -> None:
    apiserver.put(pod("a"))
    rv = apiserver.resource_version
    query = f"watch=true&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=1"
    lines = []
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{apiserver.url}/api/v1/namespaces/default/pods?{query}") as response:
            assert response.status == 200
            assert response.headers["Transfer-Encoding"] == "chunked"
            apiserver.put(pod("b"))
            async for line in response.content:
                lines.append(json.loads(line))
    assert lines[0]["type"] == "ADDED" and lines[0]["object"]["kind"] == "Pod"
    bookmarks = [e for e in lines if e["type"] == "BOOKMARK"]
    assert len(bookmarks) >= 3  # every 0.2 s for 1 s
    assert bookmarks[0]["object"] == {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": str(rv + 1)},
    }
    assert flag(apiserver.requests[-1].query["allowWatchBookmarks"])


async def test_bookmarks_reach_the_client_only_when_allowed(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    apiserver.put(pod("a"))
    apiserver.put(pool("p"))  # another kind moves the global version on
    rv = str(apiserver.resource_version - 1)
    core = kubernetes.client.CoreV1Api(kube_client)
    kwargs = {"resource_version": rv, "timeout_seconds": 1}
    allowed, plain = await asyncio.gather(
        asyncio.to_thread(
            watch_events, core.list_namespaced_pod, "default", allow_watch_bookmarks=True, **kwargs
        ),
        asyncio.to_thread(watch_events, core.list_namespaced_pod, "default", **kwargs),
    )
    assert plain == []
    assert {e["type"] for e in allowed} == {"BOOKMARK"}
    assert allowed[0]["raw_object"]["metadata"]["resourceVersion"] == str(
        apiserver.resource_version
    )


async def test_watch_from_a_compacted_version_is_410_expired(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    old = apiserver.put(pod("a"))["metadata"]["resourceVersion"]
    apiserver.put(pod("b"))
    apiserver.compact()
    core = kubernetes.client.CoreV1Api(kube_client)
    with pytest.raises(ApiException) as expired:
        await asyncio.to_thread(
            watch_events,
            core.list_namespaced_pod,
            "default",
            resource_version=old,
            timeout_seconds=5,
        )
    assert expired.value.status == 410
    assert "too old resource version" in str(expired.value.reason)
    # On the wire: HTTP 200, then one ERROR event, then the end.
    async with aiohttp.ClientSession() as http:
        url = f"{apiserver.url}/api/v1/namespaces/default/pods?watch=1&resourceVersion={old}"
        async with http.get(url) as response:
            assert response.status == 200
            lines = [json.loads(line) async for line in response.content]
    assert lines == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"too old resource version: {old} ({apiserver.resource_version})",
                "reason": "Expired",
                "details": {},
                "code": 410,
            },
        }
    ]
    # The current version is still fine, and so is an exact list at it.
    current = str(apiserver.resource_version)
    assert (
        await asyncio.to_thread(
            watch_events,
            core.list_namespaced_pod,
            "default",
            resource_version=current,
            timeout_seconds=1,
        )
        == []
    )
    with pytest.raises(ApiException) as exact:
        await asyncio.to_thread(
            core.list_namespaced_pod,
            "default",
            resource_version=old,
            resource_version_match="Exact",
        )
    assert exact.value.status == 410


async def test_custom_objects_and_uninstalled_crds(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    apiserver.put(pool("p"))
    custom = kubernetes.client.CustomObjectsApi(kube_client)
    listed = await asyncio.to_thread(custom.list_namespaced_custom_object, *POOLS)
    assert isinstance(listed, dict)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["p"]
    events = await asyncio.to_thread(
        watch_events,
        custom.list_namespaced_custom_object,
        *POOLS,
        resource_version="1",
        timeout_seconds=1,
    )
    assert [(e["type"], e["object"]["spec"]["targetPorts"]) for e in events] == [
        ("ADDED", [{"number": 8000}])
    ]
    apiserver.installed_groups.discard("inference.networking.k8s.io")
    with pytest.raises(ApiException) as absent:
        await asyncio.to_thread(custom.list_namespaced_custom_object, *POOLS)
    assert absent.value.status == 404
    assert json.loads(absent.value.body)["kind"] == "Status"
    objectives = ("inference.networking.x-k8s.io", "v1alpha2", "default", "inferenceobjectives")
    other = await asyncio.to_thread(custom.list_namespaced_custom_object, *objectives)
    assert isinstance(other, dict) and other["items"] == []


async def test_events_can_be_created_once_and_listed(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    core = kubernetes.client.CoreV1Api(kube_client)
    body = kubernetes.client.CoreV1Event(
        metadata=kubernetes.client.V1ObjectMeta(name="cm.1"),
        involved_object=kubernetes.client.V1ObjectReference(kind="ConfigMap", name="cm"),
        reason="Invalid",
        message="bad",
        type="Warning",
    )
    created = await asyncio.to_thread(core.create_namespaced_event, "default", body)
    assert created.metadata.resource_version and created.metadata.uid
    with pytest.raises(ApiException) as conflict:
        await asyncio.to_thread(core.create_namespaced_event, "default", body)
    assert conflict.value.status == 409
    [event] = apiserver.events("default")
    assert event["involvedObject"] == {"kind": "ConfigMap", "name": "cm"}
    assert event["reason"] == "Invalid" and event["kind"] == "Event"
    listed = await asyncio.to_thread(core.list_namespaced_event, "default")
    assert [e.reason for e in listed.items] == ["Invalid"]
    assert apiserver.requests[0].method == "POST"
    assert apiserver.requests[0].path == "/api/v1/namespaces/default/events"


async def test_restart_on_the_same_port_keeps_the_store(
    apiserver: ApiServerDouble, kube_client: kubernetes.client.ApiClient
) -> None:
    apiserver.put(pod("a"))
    port, rv = apiserver.port, apiserver.resource_version
    await apiserver.stop()
    core = kubernetes.client.CoreV1Api(kube_client)
    with pytest.raises(Exception, match=r"(?i)refused"):
        await asyncio.to_thread(core.list_namespaced_pod, "default", _request_timeout=1)
    apiserver.put(pod("b"))
    await apiserver.start()
    assert apiserver.port == port
    listed = await asyncio.to_thread(core.list_namespaced_pod, "default")
    assert [p.metadata.name for p in listed.items] == ["a", "b"]
    assert listed.metadata.resource_version == str(rv + 1)
