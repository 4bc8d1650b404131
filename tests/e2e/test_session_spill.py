"""Keyed traffic stays load-aware, through a real Envoy: a session key sticks to its pod
while that pod is healthy and does not queue; when it queues, new requests of its keys go
to the other pods (balanced by the pool's weights through the spill listener, or with
`spill_to: ring` each key to the next pod of its Maglev permutation), stay off while its
batch is still full, and come back once it has room. Keys of other pods stay where they
are (with `ring`, but for the few Maglev's rebuild moves, where its table says)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.conftest import eventually
from tests.e2e.session_pods import Pod, homes_on_every_pod, session_config, session_gateway
from tests.e2e.session_pods import served as serving_pod
from xds_server.app import XdsApplication
from xds_server.envoy import names, render_bootstrap
from xds_server.maglev import RING_SPILL_TABLE_SIZE, key_hash, maglev_table
from xds_server.settings import ServerSettings
from xds_testbed.envoy_process import EnvoyProcess


def _ring_homes(app: XdsApplication, keys: Iterable[str], without: int | None) -> dict[str, int]:
    """Where a `spill_to: ring` table (Envoy's 65,537 slots, as the server computes it)
    of the pool's pods but `without` puts each key."""
    pool = app.controller.decision.pools["gpu"]
    kept = [e for e in pool.endpoints if e.port != without]
    table = maglev_table({e.ring_key: e.ring_weight or 0 for e in kept}, RING_SPILL_TABLE_SIZE)
    port_of = {e.ring_key: e.port for e in kept}
    return {k: port_of[table.host_of(key_hash(k))] for k in keys}


def _other_homes(
    app: XdsApplication, home: dict[str, int], hot: int, *, left: bool
) -> dict[str, int]:
    """Where the keys of the pods other than `hot` go while it spills: their homes, or
    with `left` (it left the table) where the table of the other pods puts them."""
    others = {k: p for k, p in home.items() if p != hot}
    return _ring_homes(app, others, without=hot) if left else others


@pytest.mark.parametrize("spill_to", ["pool", "ring"])
async def test_a_queueing_pods_keys_spill_and_return_and_other_keys_stay(
    tmp_path: Path, spill_to: str
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(Pod().serving()) for _ in range(3)]
        # The hash's homes throughout (`home_max_factor` 1): the spill alone moves keys
        # here. Placing the logged keys would move some in the first windows, and a pod
        # spilling through a window has its ring weight cut (tests/e2e/test_key_homes.py).
        hash_homes = {"home_max_factor": 1}
        gateway, http = await session_gateway(
            stack, pods, tmp_path, spill_to=spill_to, advanced=hash_homes
        )
        config = gateway.app.controller.config
        assert config is not None

        async def served(user: str) -> int:
            return await serving_pod(http, gateway.url, user)

        # Where each of 60 keys lives while no pod queues (all three pods in rotation).
        home = await homes_on_every_pod(http, gateway.url, keys=60, pods=3)
        hot, cold = pods[0].port, pods[1].port
        hot_keys = [k for k, p in home.items() if p == hot]
        cold_keys = [k for k, p in home.items() if p == cold]
        assert hot_keys and cold_keys
        # Sticky: asked again, every key answers from the same pod.
        assert {k: await served(k) for k in home} == home

        # The hot pod's batch is full and it queues: its keys spill to the next pods on the
        # ring, and no other key moves.
        pods[0].running, pods[0].waiting = 16, 8

        async def spilled() -> bool:
            return all([await served(k) != hot for k in hot_keys])

        await eventually(spilled, within_s=20, what="the hot pod's keys to spill")
        # Every other key stays: with "pool" the pod keeps its slots, with "ring" it leaves
        # the table, and Maglev keeps the other pods' keys but for a few of its rebuild
        # (0.02% of slots at the median), which its table (the server's copy) says.
        stays = _other_homes(gateway.app, home, hot, left=spill_to == "ring")
        assert set(stays.values()) <= {p.port for p in pods[1:]}
        assert sum(stays[k] != home[k] for k in stays) <= len(stays) // 10, (stays, home)
        for key, port in stays.items():
            assert await served(key) == port, key
        # Where one spilled key goes: with "pool", round the other pods by their (equal)
        # weights; with "ring", always the one next pod of its permutation.
        where = {await served(hot_keys[0]) for _ in range(8)}
        others = {p.port for p in pods[1:]}
        if spill_to == "pool":
            assert where == others
        else:
            assert len(where) == 1 and where < others

        # Its queue drains, its batch still full: the keys stay off (back now, they would
        # queue at once), for ten scrape intervals and more.
        pods[0].waiting = 0
        loop = asyncio.get_running_loop()
        until = loop.time() + 10 * config.balancing.scrape_interval_s
        while loop.time() < until:
            pool = gateway.app.controller.decision.pools["gpu"]
            assert next(e.spilling for e in pool.endpoints if e.port == hot)
            for key in hot_keys:
                assert await served(key) != hot, key

        # It has room again: its keys come back (their cached prefixes are there).
        pods[0].running = 2

        async def returned() -> bool:
            return all([await served(k) == hot for k in hot_keys])

        await eventually(returned, within_s=20, what="the hot pod's keys to come back")
        assert {k: await served(k) for k in home} == home


async def test_an_envoy_without_the_internal_listener_extension_gets_spills_to_the_ring(
    tmp_path: Path,
) -> None:
    """An Envoy whose bootstrap lacks `envoy.bootstrap.internal_listener` refuses the spill
    listener (a NACK, counted, naming it). Its spilled keys would fail to connect there, so
    the server falls back to `spill_to: ring` for every Envoy (logged, exported): a
    spilling pod's keys are then served by the next pod of their ring, none refused."""
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(Pod().serving()) for _ in range(3)]
        path = tmp_path / "config.yaml"
        # The hash's homes throughout, as above.
        hash_homes = {"home_max_factor": 1}
        path.write_text(
            session_config(pods, spill_to="pool", advanced=hash_homes).model_dump_json()
        )
        settings = ServerSettings(config_path=path, xds_port=0, admin_port=0, config_poll_s=3600)
        app = await stack.enter_async_context(XdsApplication(settings))
        await app.wait_ready(within_s=20)
        registry = app.telemetry.registry
        assert registry.get_sample_value("xds_spill_to_ring_fallback") == 0
        bootstrap = render_bootstrap(
            xds_address="127.0.0.1", xds_port=app.xds_port, node_id="old-bootstrap",
            node_cluster="e2e", admin_port=0,
        )  # fmt: skip
        del bootstrap["bootstrap_extensions"]
        envoy = await stack.enter_async_context(EnvoyProcess(bootstrap))
        await envoy.wait_live(timeout=20)
        url = f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}"
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await eventually(
            lambda: registry.get_sample_value("xds_spill_to_ring_fallback") == 1,
            within_s=20,
            what="the fall back to the ring after the spill listener's NACK",
        )
        assert registry.get_sample_value("xds_nacks_total", {"type": "lds"})
        assert app.controller.spill_fallback is not None
        assert names.spill_listener_name("gpu") in app.controller.spill_fallback
        listeners = await envoy.admin_get("/listeners")
        assert names.LISTENER_NAME in listeners
        assert names.spill_listener_name("gpu") not in listeners

        async def served(user: str) -> int:
            return await serving_pod(http, url, user)

        async def homes() -> dict[str, int] | None:
            """The keys' homes, once the Envoy hashes them over the ring's table (Envoy's
            65,537 slots: the server's copy says where each key goes)."""
            found = {f"user-{i}": await served(f"user-{i}") for i in range(60)}
            ring = _ring_homes(app, found, without=None)
            return found if found == ring and len(set(found.values())) == 3 else None

        home = await eventually(homes, within_s=20, what="keys on all three pods, as the ring")
        hot = pods[0].port
        hot_keys = [k for k, p in home.items() if p == hot]
        assert hot_keys
        pods[0].running, pods[0].waiting = 16, 8

        async def spilled() -> bool:
            return all([await served(k) != hot for k in hot_keys])

        # Every request answered 200 (`serving_pod` asserts it), each spilled key by one pod.
        await eventually(spilled, within_s=20, what="the hot pod's keys to spill")
        for key in hot_keys:
            assert len({await served(key) for _ in range(4)}) == 1, key
        stays = _other_homes(app, home, hot, left=True)
        assert sum(stays[k] != home[k] for k in stays) <= len(stays) // 10, (stays, home)
        for key, port in stays.items():
            assert await served(key) == port, key
