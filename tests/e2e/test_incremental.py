"""Incremental pushes lose nothing, through a real Envoy, in both protocols.

SotW EDS responses carry only the assignments that changed (xds/sotw.py; the protocol
lets EDS and RDS omit what did not change, and Envoy keeps what a response leaves out).
What could go wrong, and is checked here on Envoy itself after each step: a partial
response dropping the other pools' endpoints; a cluster update (Envoy rebuilds that
cluster and needs its assignment again, though it did not change) leaving the cluster
warming or empty; a server restart (Envoy reconnects with the version it holds, and only
changes follow) leaving Envoy with stale or missing assignments. After every step Envoy's
hosts and weights for every pool are what the config says, and every model answers.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import pytest
import yaml

from tests.e2e.conftest import ConfigFile, chat, eventually
from xds_server.app import XdsApplication
from xds_server.envoy import names, render_bootstrap
from xds_server.settings import ServerSettings
from xds_server.xds.resources import ResourceType
from xds_testbed.backends import ExampleBackend
from xds_testbed.envoy_process import EnvoyProcess

POOLS = ("a", "b", "c")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _hosts(envoy: EnvoyProcess) -> dict[str, dict[int, int]]:
    """Envoy's view: per pool cluster, port -> weight."""
    view: dict[str, dict[int, int]] = {}
    for status in (await envoy.clusters_json()).get("cluster_statuses", []):
        if status["name"] in POOLS:
            view[status["name"]] = {
                h["address"]["socket_address"]["port_value"]: int(h.get("weight", 1))
                for h in status.get("host_statuses", [])
            }
    return view


def _expected(
    backends: dict[str, ExampleBackend], weights: dict[str, int]
) -> dict[str, dict[int, int]]:
    return {pool: {backends[pool].port: weights[pool]} for pool in POOLS}


def _write(
    config_file: ConfigFile,
    backends: dict[str, ExampleBackend],
    weights: dict[str, int],
    *,
    round_robin: frozenset[str] = frozenset(),
) -> None:
    document: dict[str, Any] = {
        pool: ([f"model-{pool}"], [(backends[pool], weights[pool])]) for pool in POOLS
    }
    config_file.write(document)
    if round_robin:
        # One pool's cluster changes (its load balancing policy), its assignment does not.
        text = yaml.safe_load(config_file.path.read_text())
        for pool in text["pools"]:
            if pool["name"] in round_robin:
                pool["balancing"] = "round_robin"
        tmp = config_file.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(text))
        tmp.replace(config_file.path)


async def _agrees(
    envoy: EnvoyProcess,
    http: aiohttp.ClientSession,
    expected: dict[str, dict[int, int]],
    what: str,
) -> None:
    async def same() -> bool:
        return await _hosts(envoy) == expected

    await eventually(same, within_s=20, what=f"Envoy to hold every pool's endpoints {what}")
    url = f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}"
    for pool in POOLS:
        status, _, _ = await chat(http, url, f"model-{pool}")
        assert status == 200, f"model-{pool} {what}: HTTP {status}"


def _version(app: XdsApplication, resource_type: ResourceType) -> str | None:
    snapshot = app.controller.snapshot
    return None if snapshot is None else snapshot.versions[resource_type]


def _eds_resources_sent(app: XdsApplication) -> float:
    value = app.telemetry.registry.get_sample_value("xds_resources_sent_total", {"type": "eds"})
    return value or 0.0


@pytest.mark.parametrize("protocol", ["sotw", "delta"])
async def test_incremental_pushes_lose_nothing_across_cluster_updates_and_reconnects(  # type: ignore[no-untyped-def]
    backends, config_file: ConfigFile, http: aiohttp.ClientSession, protocol: str
) -> None:
    started = {pool: await backends(pool) for pool in POOLS}
    weights = dict.fromkeys(POOLS, 1)
    _write(config_file, started, weights)
    settings = ServerSettings(
        config_path=config_file.path, xds_port=_free_port(), admin_port=0, config_poll_s=0.05
    )
    bootstrap = render_bootstrap(
        xds_address="127.0.0.1", xds_port=settings.xds_port, node_id="incremental",
        node_cluster="e2e", admin_port=0, delta=protocol == "delta",
    )  # fmt: skip
    async with EnvoyProcess(bootstrap) as envoy:
        async with XdsApplication(settings) as first:
            await envoy.wait_live(timeout=30)
            await _agrees(envoy, http, _expected(started, weights), "at first")

            # One pool's weight: an EDS push of that pool's assignment alone.
            sent = _eds_resources_sent(first)
            weights["b"] = 5
            _write(config_file, started, weights)
            await _agrees(envoy, http, _expected(started, weights), "after b's weight changed")
            assert _eds_resources_sent(first) - sent == 1

            # One pool's cluster: Envoy rebuilds it and is sent its unchanged assignment
            # again (and only that one); the cluster does not stay warming or empty.
            sent = _eds_resources_sent(first)
            clusters = _version(first, ResourceType.CLUSTER)
            _write(config_file, started, weights, round_robin=frozenset({"a"}))
            await eventually(
                lambda: _version(first, ResourceType.CLUSTER) != clusters,
                what="the new clusters",
            )
            # Envoy ACKs the clusters once the updated one has warmed, which takes its
            # assignment: sent only after that ACK, it came at Envoy's initial fetch
            # timeout (15 s) with Delta xDS.
            await asyncio.wait_for(
                first.registry.wait_for_ack("cds", _version(first, ResourceType.CLUSTER)),
                timeout=10,
            )
            await eventually(
                lambda: _eds_resources_sent(first) - sent >= 1,
                what="a's assignment sent again",
            )
            await _agrees(envoy, http, _expected(started, weights), "after a's cluster changed")
            assert _eds_resources_sent(first) - sent == 1
            warming = await envoy.get_stats(r"^cluster_manager\.warming_clusters$")
            assert warming.get("cluster_manager.warming_clusters") == 0

        # The server restarts on the same port while the config changes: Envoy comes back
        # with what it holds, and gets what changed.
        weights["c"] = 3
        _write(config_file, started, weights, round_robin=frozenset({"a"}))
        async with XdsApplication(settings) as second:
            await eventually(
                lambda: any(r.node_id == "incremental" for r in second.registry.streams()),
                within_s=20,
                what="Envoy to reconnect",
            )
            await _agrees(envoy, http, _expected(started, weights), "after the restart")
            weights["a"] = 2
            _write(config_file, started, weights, round_robin=frozenset({"a"}))
            await _agrees(envoy, http, _expected(started, weights), "after a change since")
            rejected = await envoy.get_stats(r"update_rejected$")
            assert rejected and not any(rejected.values()), rejected
