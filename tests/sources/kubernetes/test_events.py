"""`EventRecorder` against the API server double, with the real `kubernetes` client."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry

from tests.sources.kubernetes.apiserver import ApiServerDouble
from xds_server.sources.kubernetes.client import api_client
from xds_server.sources.kubernetes.events import EventRecorder, event_for
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

LOGGER = "xds_server.sources.kubernetes.events"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def recorder(
    apiserver: ApiServerDouble, registry: CollectorRegistry
) -> AsyncIterator[EventRecorder]:
    client = api_client(host=apiserver.url)
    telemetry = KubernetesTelemetry(registry)
    try:
        yield EventRecorder(client, instance="xds-server-0", telemetry=telemetry, timeout_s=2)
    finally:
        client.close()


def recorded(registry: CollectorRegistry, result: str) -> float:
    value = registry.get_sample_value("xds_kubernetes_events_recorded_total", {"result": result})
    assert value is not None
    return value


async def test_an_event_names_the_object_and_this_server(
    apiserver: ApiServerDouble, recorder: EventRecorder, registry: CollectorRegistry
) -> None:
    configmap = apiserver.put(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "routing", "namespace": "ml"},
            "data": {"config.yaml": "pools: ["},
        }
    )
    await recorder.record(
        involved=configmap, reason="InvalidConfig", message="pools: not a list; keeping the last"
    )
    [event] = apiserver.events("ml")
    meta = configmap["metadata"]
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "routing",
        "namespace": "ml",
        "uid": meta["uid"],
        "resourceVersion": meta["resourceVersion"],
    }
    assert event["metadata"]["name"].startswith("routing.")
    assert event["reason"] == "InvalidConfig" and event["type"] == "Warning"
    assert event["message"] == "pools: not a list; keeping the last"
    assert event["reportingComponent"] == "xds-server"
    assert event["reportingInstance"] == "xds-server-0"
    assert event["source"] == {"component": "xds-server", "host": "xds-server-0"}
    assert event["count"] == 1
    assert event["firstTimestamp"] == event["lastTimestamp"]
    assert datetime.strptime(event["firstTimestamp"], "%Y-%m-%dT%H:%M:%S%z").tzinfo is not None
    [post] = [r for r in apiserver.requests if r.method == "POST"]
    assert post.path == "/api/v1/namespaces/ml/events"
    assert recorded(registry, "ok") == 1


async def test_each_record_is_a_new_event(
    apiserver: ApiServerDouble, recorder: EventRecorder
) -> None:
    pod = apiserver.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})
    await recorder.record(involved=pod, reason="Scraped", message="ok", type="Normal")
    await recorder.record(involved=pod, reason="Scraped", message="ok", type="Normal")
    events = apiserver.events("default")
    assert len({e["metadata"]["name"] for e in events}) == 2
    assert {e["type"] for e in events} == {"Normal"}


async def test_failures_are_logged_once_counted_and_never_raised(
    apiserver: ApiServerDouble,
    recorder: EventRecorder,
    caplog: pytest.LogCaptureFixture,
    registry: CollectorRegistry,
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    pod = apiserver.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})
    await apiserver.stop()
    await recorder.record(involved=pod, reason="A", message="one")
    await recorder.record(involved=pod, reason="B", message="two")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("Recording the Warning Event 'A' on Pod default/p failed")
    assert "routing is not affected" in warnings[0]
    assert recorded(registry, "error") == 2
    await apiserver.start()
    await recorder.record(involved=pod, reason="C", message="three")
    assert [e["reason"] for e in apiserver.events()] == ["C"]
    assert "works again" in caplog.text


async def test_a_refused_event_is_a_failure_too(
    apiserver: ApiServerDouble,
    recorder: EventRecorder,
    caplog: pytest.LogCaptureFixture,
    registry: CollectorRegistry,
) -> None:
    pod = apiserver.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})
    apiserver.forbidden_creates.add("events")  # no RBAC for events
    await recorder.record(involved=pod, reason="A", message="x")
    assert apiserver.events() == []
    assert recorded(registry, "error") == 1
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "failed with HTTP 403" in warning and "cannot create resource" in warning


def test_event_for_cluster_scoped_objects_long_messages_and_long_names() -> None:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n" * 300, "uid": "u"}}
    event = event_for(
        involved=node,
        reason="R",
        message="m" * 5000,
        type="Normal",
        component="xds-server",
        instance="i",
        now=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )
    assert event["metadata"]["namespace"] == "default"
    assert len(event["metadata"]["name"]) == 253
    assert len(event["message"]) == 1024 and event["message"].endswith("…")
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "n" * 300,
        "uid": "u",
    }
    assert event["firstTimestamp"] == "2026-01-02T03:04:05Z"
