"""Key homes and whether affinity pays, through a real Envoy (policy/homes.py, affinity.py).

The first three are hash homes' (`balancing.key_homes: hash`; key buckets, the default:
test_key_buckets.py):

- A pod that spills its keys for a window while it carries far beyond its share gets a
  smaller weight in the session table: some of its keys move to the other pods for good
  (they stay there once it has room again), the rest come back to it.
- Keys the Envoy logs are placed: the server builds Envoy's Maglev table itself and steps
  the ring weights until each pod is home to its share of the keys, and each key goes
  where that table says.
- A replica without Envoys of its own places the keys its peer's Envoy logged, and the
  peer follows its homes.
- A pool whose prefix caches save few tokens per request stops sticking: one key's
  requests go round the pods, balanced by load; once the caches save many, keys stick
  again. The pool's gauge and the pods' reasons say so.
- Those tokens are judged per request that returned to its key's pod: while every key
  is new (a fresh fleet's first requests miss wherever they go), the keys stick; once
  the requests return and still save little, they stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from tests.e2e.conftest import eventually
from tests.e2e.session_pods import Pod, homes_on_every_pod, peered_leader, session_gateway
from tests.e2e.session_pods import served as serving_pod
from xds_server.app import XdsApplication
from xds_server.maglev import MaglevTable, key_hash, maglev_table, table_size
from xds_server.policy.state import PoolState


async def test_a_pod_that_keeps_spilling_hands_some_of_its_keys_to_the_others_for_good(
    tmp_path: Path,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [
            await stack.enter_async_context(Pod(running=4, saved=2_000).serving()) for _ in range(3)
        ]
        # A window of 10 decisions (1 s); the caches pay, so keys stick throughout. The
        # spill rule: pools of over 2 pods do not have their logged keys placed.
        advanced = {"home_window_intervals": 10, "home_placed_max_pods": 2}
        gateway, http = await session_gateway(
            stack, pods, tmp_path, advanced=advanced, key_homes="hash"
        )

        async def served(user: str) -> int:
            return await serving_pod(http, gateway.url, user)

        home = await homes_on_every_pod(http, gateway.url, keys=90, pods=3)
        hot = pods[0].port
        hot_keys = [k for k, p in home.items() if p == hot]
        assert len(hot_keys) >= 10, home

        # The hot pod runs a full batch and queues, window after window: it spills, and
        # carries 24 of the pool's 32 requests, three times its share.
        pods[0].running, pods[0].waiting = 16, 8

        def cut() -> bool:
            pool = gateway.app.controller.decision.pools["gpu"]
            return any(
                r.code == "home_share" for e in pool.endpoints if e.port == hot for r in e.reasons
            )

        await eventually(cut, within_s=30, what="the spilling pod's ring weight cut")
        pool = gateway.app.controller.decision.pools["gpu"]
        rings = {e.port: e.ring_weight for e in pool.endpoints}
        assert rings[hot] is not None
        assert all(w is not None and rings[hot] < w for p, w in rings.items() if p != hot)

        # It has room again: it takes back the keys still in its slots, the moved ones stay.
        pods[0].running, pods[0].waiting = 4, 0

        async def settled() -> dict[str, int] | None:
            """Where the hot pod's keys go once it no longer spills, asked twice alike (a
            spilled key's request may also land on it, balanced by load)."""
            pool = gateway.app.controller.decision.pools["gpu"]
            if any(e.spilling for e in pool.endpoints):
                return None
            now = {k: await served(k) for k in hot_keys}
            again = {k: await served(k) for k in hot_keys}
            return now if now == again and hot in now.values() else None

        now = await eventually(settled, within_s=30, what="the hot pod's remaining keys back")
        moved = [k for k in hot_keys if now[k] != hot]
        assert 0 < len(moved) < len(hot_keys), (len(moved), len(hot_keys))
        assert {k: await served(k) for k in moved} == {k: now[k] for k in moved}


async def test_keys_stop_sticking_where_the_caches_save_little_and_stick_again_where_they_pay(
    tmp_path: Path,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        # The caches save 100 tokens per request, far under affinity_min_cached_tokens.
        pods = [
            await stack.enter_async_context(Pod(running=4, saved=100).serving()) for _ in range(3)
        ]
        advanced = {"affinity_streak_intervals": 10}
        gateway, http = await session_gateway(stack, pods, tmp_path, advanced=advanced)
        registry = gateway.app.telemetry.registry

        def suspended() -> float | None:
            return registry.get_sample_value("xds_pool_affinity_suspended", {"pool": "gpu"})

        await eventually(lambda: suspended() == 1, within_s=30, what="affinity suspended")
        pool = gateway.app.controller.decision.pools["gpu"]
        assert all([r.code for r in e.reasons] == ["affinity_suspended"] for e in pool.endpoints), (
            pool
        )

        async def spread() -> bool:
            return len({await serving_pod(http, gateway.url, "user-1") for _ in range(30)}) == 3

        await eventually(spread, within_s=20, what="one key's requests round the pods")

        for pod in pods:
            pod.saved = 2_000
        await eventually(lambda: suspended() == 0, within_s=30, what="affinity back")

        async def sticks() -> bool:
            return len({await serving_pod(http, gateway.url, "user-1") for _ in range(30)}) == 1

        await eventually(sticks, within_s=20, what="one key's requests on one pod")


async def test_a_fleet_whose_keys_are_all_new_is_not_judged_until_requests_return(
    tmp_path: Path,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        # 200 tokens per request: under the minimum (512) per request, and per return on
        # a pod once more than 39% of the keyed requests it is sent return to it.
        pods = [
            await stack.enter_async_context(Pod(running=4, saved=200).serving()) for _ in range(3)
        ]
        streak = 10
        advanced = {"affinity_streak_intervals": streak}
        gateway, http = await session_gateway(stack, pods, tmp_path, advanced=advanced)
        registry = gateway.app.telemetry.registry
        controller = gateway.app.controller

        def suspended() -> float | None:
            return registry.get_sample_value("xds_pool_affinity_suspended", {"pool": "gpu"})

        async def send(keys: Iterator[str]) -> None:
            for key in keys:
                await serving_pod(http, gateway.url, key)

        def shares() -> list[float]:
            return list(gateway.app.logged_keys.returns().get("gpu", {}).values())

        sending = asyncio.create_task(send(f"new-{i}" for i in itertools.count()))
        try:
            await eventually(lambda: shares() == [0.0] * 3, within_s=30, what="new keys logged")
            decisions = [controller.decision]

            def decided(count: int) -> bool:
                if controller.decision is not decisions[-1]:
                    decisions.append(controller.decision)
                return len(decisions) > count

            # Three streaks' worth of busy decisions on new keys alone: per request the
            # pool would have been suspended after the first.
            await eventually(lambda: decided(3 * streak), within_s=60, what="decisions")
            assert suspended() == 0
            assert shares() == [0.0] * 3
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending

        sending = asyncio.create_task(send(itertools.repeat("user-1")))
        try:
            await eventually(lambda: suspended() == 1, within_s=60, what="affinity suspended")
            assert max(shares()) > 200 / 512
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending


# How far from its share of 8 keys a pod is left once placed: the tolerance (20%) and one
# key (homes.py: no pod is moved for less).
PLACED = 0.2 + 1 / 8


def _table(state: PoolState) -> MaglevTable:
    """The pool's session table as the server's ring weights make it."""
    size = table_size(len(state.endpoints))
    return maglev_table({e.ring_key: e.ring_weight or 0 for e in state.endpoints}, size)


def _uneven_keys(pool: PoolState) -> list[str]:
    """32 keys the hash drops 14/8/6/4 on the pool's pods as they start (equal weights)."""
    start = _table(pool)
    wanted = dict(zip(start.hosts, (14, 8, 6, 4), strict=True))
    keys: list[str] = []
    for i in range(10_000):
        host = start.host_of(key_hash(f"user-{i}"))
        if wanted[host]:
            wanted[host] -= 1
            keys.append(f"user-{i}")
    assert len(keys) == 32
    return keys


async def test_logged_keys_are_placed_evenly_and_go_where_the_server_computes(
    tmp_path: Path,
) -> None:
    """Keys Maglev drops unevenly (14/8/6/4 over four pods) are logged by the Envoy, and
    within a window the server steps the ring weights until each pod is home to its share
    of them (within the tolerance and a key); every key then goes where the server's copy
    of Envoy's table says."""
    async with contextlib.AsyncExitStack() as stack:
        pods = [
            await stack.enter_async_context(Pod(running=4, saved=2_000).serving()) for _ in range(4)
        ]
        advanced = {"home_window_intervals": 10}
        gateway, http = await session_gateway(
            stack, pods, tmp_path, advanced=advanced, key_homes="hash"
        )
        pool = gateway.app.controller.decision.pools["gpu"]
        keys = _uneven_keys(pool)
        port_of = {e.ring_key: e.port for e in pool.endpoints}

        async def placed() -> PoolState | None:
            for key in keys:
                await serving_pod(http, gateway.url, key)
            state = gateway.app.controller.decision.pools["gpu"]
            homes = Counter(_table(state).host_of(key_hash(k)) for k in keys)
            even = all(abs(homes[e.ring_key] / 8 - 1) <= PLACED for e in state.endpoints)
            return state if even else None

        state = await eventually(placed, within_s=40, what="the logged keys placed evenly")
        assert any(r.code == "home_share" for e in state.endpoints for r in e.reasons), state
        now = _table(state)
        for key in keys:
            assert await serving_pod(http, gateway.url, key) == port_of[now.host_of(key_hash(key))]


async def test_a_replica_places_the_keys_its_peers_envoys_logged(tmp_path: Path) -> None:
    """Two peered replicas; only the first has an Envoy, which logs the keys. The second
    ("other", whose name sorts first) takes them from its peer's reports and places them;
    the first follows its homes: an Envoy of either replica sends every key to the same
    pod, each pod home to its share of the keys."""
    async with contextlib.AsyncExitStack() as stack:
        pods = [
            await stack.enter_async_context(Pod(running=4, saved=2_000).serving()) for _ in range(4)
        ]
        advanced = {"home_window_intervals": 10}
        gateway, http = await session_gateway(
            stack, pods, tmp_path, advanced=advanced, key_homes="hash"
        )
        other = await peered_leader(stack, gateway, tmp_path)
        keys = _uneven_keys(gateway.app.controller.decision.pools["gpu"])

        def homes(app: XdsApplication) -> dict[str, str]:
            table = _table(app.controller.decision.pools["gpu"])
            return {k: table.host_of(key_hash(k)) for k in keys}

        async def placed_alike() -> dict[str, str] | None:
            for key in keys:
                await serving_pod(http, gateway.url, key)
            placed = homes(other)
            counts = Counter(placed.values())
            even = len(counts) == 4 and all(abs(n / 8 - 1) <= PLACED for n in counts.values())
            return placed if even and homes(gateway.app) == placed else None

        await eventually(placed_alike, within_s=60, what="both replicas placing the keys alike")
        # The Envoy's replica follows: its reasons say whose homes they are.
        state = gateway.app.controller.decision.pools["gpu"]
        assert any(r.code == "home_share" for e in state.endpoints for r in e.reasons), state
        # The other replica's own Envoys logged nothing: the keys came from its peer.
        assert other.logged_keys.own() == {}
        assert set(other.logged_keys()["gpu"]) == {key_hash(k) for k in keys}
