"""The controller: debouncing, EDS-only rebuilds, and keeping the last good snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from xds_server.config import parse_config
from xds_server.controller import Controller, SnapshotBuilder
from xds_server.errors import ConfigError
from xds_server.telemetry import Telemetry
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.resources import ResourceType


def config(
    weight: int = 1, *, models: str = "[m]", debounce_s: float = 0.05, max_delay_s: float = 1.0
):  # type: ignore[no-untyped-def]
    return parse_config(
        f"""
        updates: {{debounce_s: {debounce_s}, max_delay_s: {max_delay_s}}}
        pools:
          - name: pool
            models: {models}
            endpoints: [{{address: 10.0.0.1, port: 8000, weight: {weight}}}]
        """
    )


@pytest.fixture
async def running() -> AsyncIterator[tuple[Controller, SnapshotCache, Telemetry]]:
    telemetry, cache = Telemetry(), SnapshotCache()
    controller = Controller(cache=cache, telemetry=telemetry)
    task = asyncio.create_task(controller.run())
    yield controller, cache, telemetry
    task.cancel()


def test_endpoint_only_change_rebuilds_only_endpoints() -> None:
    builder = SnapshotBuilder()
    first = builder.build(config(1))
    second = builder.build(config(2))
    for kept in (ResourceType.CLUSTER, ResourceType.LISTENER, ResourceType.ROUTE):
        assert second.resources[kept] is first.resources[kept]
    assert second.versions[ResourceType.ENDPOINT] != first.versions[ResourceType.ENDPOINT]
    third = builder.build(config(2, models="[m, n]"))
    assert third.versions[ResourceType.ROUTE] != second.versions[ResourceType.ROUTE]
    assert third.versions[ResourceType.CLUSTER] == second.versions[ResourceType.CLUSTER]


async def test_a_burst_of_changes_makes_one_snapshot(running) -> None:  # type: ignore[no-untyped-def]
    controller, cache, telemetry = running
    for weight in range(1, 11):
        controller.submit(config(weight))
        await asyncio.sleep(0.005)
    snapshot = await asyncio.wait_for(controller.settled(), 2)
    assert snapshot is not None
    assert telemetry.registry.get_sample_value("xds_snapshot_updates_total", {"group": ""}) == 1
    entry = cache.entry_for("")
    assert entry is not None and entry.snapshot is snapshot
    [cla] = snapshot.resources[ResourceType.ENDPOINT].values()
    assert cla.message.endpoints[0].lb_endpoints[0].load_balancing_weight.value == 10


async def test_max_delay_bounds_a_never_ending_burst(running) -> None:  # type: ignore[no-untyped-def]
    controller, _, telemetry = running
    loop = asyncio.get_running_loop()
    started = loop.time()
    weight = 1
    while telemetry.registry.get_sample_value("xds_snapshot_updates_total", {"group": ""}) is None:
        weight += 1
        controller.submit(config(weight, debounce_s=0.1, max_delay_s=0.3))
        await asyncio.sleep(0.02)
        assert loop.time() - started < 2, "no snapshot although changes kept coming"
    assert loop.time() - started >= 0.25


async def test_rejected_config_keeps_the_last_good_snapshot(running) -> None:  # type: ignore[no-untyped-def]
    controller, cache, telemetry = running
    controller.submit(config(3))
    good = await asyncio.wait_for(controller.settled(), 2)
    controller.reject(ConfigError("config.yaml: pools.0.name: bad"))
    assert controller.last_error == "config.yaml: pools.0.name: bad"
    assert controller.ready and controller.snapshot is good
    entry = cache.entry_for("")
    assert entry is not None and entry.snapshot is good
    assert telemetry.registry.get_sample_value("xds_config_reloads_total", {"result": "error"}) == 1
    assert telemetry.registry.get_sample_value("xds_config_last_reload_successful") == 0
