"""The routing config from a ConfigMap, through the API server double: hostile documents
refused with a Warning Event while the server keeps answering, a config that leaves a
pool without endpoints accepted with a Warning Event, and one that empties a pool which
listed endpoints refused with one."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from tests.e2e.conftest import eventually
from tests.sources.kubernetes.apiserver import ApiServerDouble
from tests.sources.stalls import BOUND_S, alias_bomb, giant_document, least_stalls, slow_document
from xds_server.app import XdsApplication
from xds_server.config import RoutingConfig
from xds_server.errors import ConfigError
from xds_server.settings import KubernetesSettings, ServerSettings, WatchSettings
from xds_server.sources.kubernetes.client import api_client
from xds_server.sources.kubernetes.configmap import watch_configmap
from xds_server.sources.kubernetes.events import EventRecorder
from xds_server.telemetry import Telemetry

NAMESPACE = "ml"
NAME = "xds-server-config"
FAST_WATCHES = WatchSettings(backoff_s=(0.05, 0.1, 0.2))

APP_CONFIG = """
listener: {address: 127.0.0.1, port: 0}
updates: {debounce_s: 0.01}
pools: [{name: pool, models: [m], endpoints: [{address: 127.0.0.1, port: 9}]}]
"""


def configmap(document: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "data": {"config.yaml": document},
    }


async def test_hostile_configmaps_are_refused_while_the_server_keeps_answering(
    apiserver: ApiServerDouble,
) -> None:
    """The issue's attacks as ConfigMaps: each refused with a Warning Event saying what was
    wrong, counted, the last good config kept, and the loop stalled less than BOUND_S. (The
    API server refuses a ConfigMap over 1 MiB; the double does not.)"""
    hostile = {
        "a 1.7 MB ConfigMap": (giant_document(2), "over the limit of 1048576 bytes"),
        "an alias bomb": (alias_bomb().encode(), "more than 256 YAML aliases"),
        "0.9 MB within the limits": (slow_document(), "endpoint 10.0.0.0:8000 listed twice"),
    }
    apiserver.put(configmap(APP_CONFIG))
    settings = ServerSettings(
        kubernetes=KubernetesSettings(
            namespace=NAMESPACE,
            watch_namespaces=(NAMESPACE,),
            configmap=NAME,
            api_host=apiserver.url,
            watch=FAST_WATCHES,
        ),
        xds_port=0,
        admin_port=0,
    )
    async with XdsApplication(settings) as app:
        await app.wait_ready(within_s=30)
        good = app.controller.config
        registry = app.telemetry.registry
        refused = 0.0

        def errors() -> float:
            return registry.get_sample_value("xds_config_reloads_total", {"result": "error"}) or 0

        for name, (document, message) in hostile.items():

            async def attempt(i: int, document: bytes = document) -> None:
                nonlocal refused
                # A longer comment each time: a new document (and size) to refuse.
                apiserver.put(configmap(document.decode() + "#" * (i + 1) + "\n"))
                refused += 1
                await eventually(lambda: errors() == refused, within_s=60, what="the refusal")

            stalls = await least_stalls(
                attempt, probe_url=f"http://127.0.0.1:{app.admin_port}/healthz"
            )
            assert stalls.worst_s < BOUND_S, (name, stalls)
            assert stalls.probes > 0
            event = [e for e in apiserver.events(NAMESPACE) if e["reason"] == "InvalidConfig"][-1]
            assert event["type"] == "Warning"
            assert event["involvedObject"]["name"] == NAME
            assert message in event["message"], name
            assert message in (app.controller.last_error or ""), name
            assert app.controller.config == good, name


async def test_a_configmap_leaving_a_pool_without_endpoints_is_applied_with_a_warning(
    apiserver: ApiServerDouble, caplog: pytest.LogCaptureFixture
) -> None:
    selected = "{name: b, models: [n], selector: {match_labels: {app: b}, target_port: 80}}"
    apiserver.put(configmap(f"pools: [{{name: a, models: [m]}}, {selected}]"))
    client = api_client(host=apiserver.url)
    telemetry = Telemetry()
    documents = watch_configmap(
        client,
        namespace=NAMESPACE,
        name=NAME,
        events=EventRecorder(client, instance="xds-server-0", timeout_s=5),
        watch=FAST_WATCHES,
        server_telemetry=telemetry,
    )

    def warnings() -> float | None:
        return telemetry.registry.get_sample_value(
            "xds_config_warnings_total", {"reason": "pool_without_endpoints"}
        )

    try:
        with caplog.at_level(logging.WARNING, logger="xds_server.sources"):
            config = await asyncio.wait_for(anext(documents), 30)
        assert isinstance(config, RoutingConfig)
        events = [(e["reason"], e["type"]) for e in apiserver.events(NAMESPACE)]
        assert events == [("ConfigApplied", "Normal"), ("PoolWithoutEndpoints", "Warning")]
        warning = apiserver.events(NAMESPACE)[1]
        assert warning["involvedObject"]["name"] == NAME
        assert warning["message"] == (
            f"ConfigMap {NAMESPACE}/{NAME}: accepted, but 1 pool(s) have no endpoints and no "
            "selector; only an InferencePool of the same name can add pods: 'a'. Their models "
            "are answered 503 no_healthy_upstream."
        )
        # Warnings only: a test before may have left a logger below (the CLI's tests set
        # the levels of the server's loggers), so INFO records can be captured too.
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert logged == [warning["message"]]
        assert warnings() == 1

        # A pool with a selector has the pods it finds (none Ready, for a moment, in a
        # rollout): no warning.
        apiserver.put(configmap(f"pools: [{selected}]"))
        config = await asyncio.wait_for(anext(documents), 30)
        assert isinstance(config, RoutingConfig)
        assert [e["reason"] for e in apiserver.events(NAMESPACE)][2:] == ["ConfigApplied"]
        assert warnings() == 1
    finally:
        await documents.aclose()
        client.close()


async def test_a_configmap_that_empties_a_pool_is_refused_with_a_warning_event(
    apiserver: ApiServerDouble,
) -> None:
    listed = "{name: a, models: [m], endpoints: [{address: 10.0.0.1, port: 80}]}"
    apiserver.put(configmap(f"pools: [{listed}]"))
    client = api_client(host=apiserver.url)
    documents = watch_configmap(
        client,
        namespace=NAMESPACE,
        name=NAME,
        events=EventRecorder(client, instance="xds-server-0", timeout_s=5),
        watch=FAST_WATCHES,
    )
    try:
        assert isinstance(await asyncio.wait_for(anext(documents), 30), RoutingConfig)
        apiserver.put(configmap("pools: [{name: a, models: [m], endpoints: []}]"))
        refused = await asyncio.wait_for(anext(documents), 30)
        assert isinstance(refused, ConfigError)
        assert "'a' (had 1)" in str(refused)
        event = apiserver.events(NAMESPACE)[-1]
        assert (event["reason"], event["type"]) == ("InvalidConfig", "Warning")
        assert event["message"] == str(refused)

        # The pool says so: applied, with the warning about the empty pool.
        apiserver.put(configmap("pools: [{name: a, models: [m], allow_empty: true}]"))
        allowed = await asyncio.wait_for(anext(documents), 30)
        assert isinstance(allowed, RoutingConfig) and allowed.pools[0].endpoints == ()
        reasons = [e["reason"] for e in apiserver.events(NAMESPACE)][-2:]
        assert reasons == ["ConfigApplied", "PoolWithoutEndpoints"]
    finally:
        await documents.aclose()
        client.close()
