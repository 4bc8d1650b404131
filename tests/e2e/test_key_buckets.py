"""Key buckets (`balancing.key_homes: buckets`, policy/buckets.py) through a real Envoy.

- Keys arriving one by one (18) are homed at first sight on the pods with the fewest, and each
  stays on its pod: no pod ends more than one key off another, and no key moves; every
  bucket no pod holds is offered (with `key_spare_slack` 0 and `key_offer_width` 1).
- New keys that arrive together, each while the others are in flight, go to different
  pods (the defaults: every pod not spilling takes new keys, by fewest in flight).
- A pod that just took a new key's first request is passed over by the next new key,
  though it has the fewest in flight, until `new_key_prefill_s` has passed.
- A pod that stops serving loses its keys to the others, with no request lost; once
  there, each key stays where it landed.
- A replica without Envoys of its own pins the keys its peer's Envoy logged where that
  Envoy served them, and the peer follows its table.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from tests.e2e.conftest import eventually
from tests.e2e.session_pods import Pod, peered_leader, served, session_gateway
from xds_server.app import XdsApplication
from xds_server.maglev import key_hash
from xds_server.xds.resources import ResourceType
from xds_testbed.gateway import LocalGateway

BUCKETS = 64


def _pinned(gateway: LocalGateway, user: str) -> bool:
    """Whether the server pinned the bucket of `user`'s key to a pod."""
    pool = gateway.app.controller.decision.pools["gpu"]
    bucket = key_hash(user) % BUCKETS
    return any(bucket in e.key_buckets for e in pool.endpoints)


async def _bucket_gateway(
    stack: contextlib.AsyncExitStack, tmp_path: Path, pods: int, **balancing: Any
) -> tuple[list[Pod], LocalGateway, aiohttp.ClientSession]:
    """`pods` pods with prefix caches that pay, and a gateway keeping their keys in
    `BUCKETS` buckets, with `balancing` added; closed with `stack`."""
    serving = [
        await stack.enter_async_context(Pod(running=4, saved=2_000).serving()) for _ in range(pods)
    ]
    gateway, http = await session_gateway(
        stack, serving, tmp_path, key_homes="buckets", key_buckets=BUCKETS, **balancing
    )
    return serving, gateway, http


async def test_keys_are_homed_at_first_sight_on_the_pods_with_fewest_and_stay(
    tmp_path: Path,
) -> None:
    """With `key_spare_slack` 0 and `key_offer_width` 1 (the earlier defaults), only the
    pods at or under their share of the keys take new ones, each bucket offered to one."""
    async with contextlib.AsyncExitStack() as stack:
        _, gateway, http = await _bucket_gateway(
            stack, tmp_path, 3, advanced={"key_spare_slack": 0, "key_offer_width": 1}
        )
        users = []
        for n in range(300):
            user = f"user-{n}"
            if any(key_hash(user) % BUCKETS == key_hash(u) % BUCKETS for u in users):
                continue  # one key a bucket: each is placed on its own
            users.append(user)
            await served(http, gateway.url, user)
            await eventually(lambda u=user: _pinned(gateway, u), within_s=20, what="a pin")
            if len(users) == 18:
                break
        homes = {u: await served(http, gateway.url, u) for u in users}
        per_pod = Counter(homes.values())
        assert len(per_pod) == 3 and max(per_pod.values()) - min(per_pod.values()) <= 1, per_pod
        assert {u: await served(http, gateway.url, u) for u in users} == homes
        # The pods' gauges count the same pins and offers, and every other bucket is
        # offered to a spare, or to the one spare left through the default subset (read
        # together: no decision in between).
        gauges = {
            (family.name, sample.labels["endpoint"]): sample.value
            for family in gateway.app.telemetry.registry.collect()
            if family.name in ("xds_pod_key_buckets", "xds_pod_key_offers")
            for sample in family.samples
        }
        pool = gateway.app.controller.decision.pools["gpu"]
        pinned = {e: n for (name, e), n in gauges.items() if name == "xds_pod_key_buckets"}
        assert pinned == {f"127.0.0.1:{port}": n for port, n in per_pod.items()}
        offered = {e: n for (name, e), n in gauges.items() if name == "xds_pod_key_offers"}
        assert offered == {e.id: len(e.key_offers) for e in pool.endpoints}
        listed = {b for e in pool.endpoints for b in (*e.key_buckets, *e.key_offers)}
        if sum(e.key_spare for e in pool.endpoints) > 1:
            assert listed == set(range(BUCKETS))
        else:  # one spare is every spare: Envoy's default subset sends the rest to it
            assert not any(e.key_offers for e in pool.endpoints)


async def test_a_pod_that_stops_serving_hands_its_keys_to_the_others(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [
            await stack.enter_async_context(Pod(running=4, saved=2_000).serving()) for _ in range(2)
        ]
        stopped = contextlib.AsyncExitStack()
        last = await stopped.enter_async_context(Pod(running=4, saved=2_000).serving())
        gateway, http = await session_gateway(
            stack, [*pods, last], tmp_path, key_homes="buckets", key_buckets=BUCKETS
        )

        users = [f"user-{n}" for n in range(40)]

        async def homes() -> dict[str, int] | None:
            """Where each key lives once every one is pinned and some are on the last pod."""
            found = {u: await served(http, gateway.url, u) for u in users}
            if not all(_pinned(gateway, u) for u in users) or last.port not in found.values():
                return None
            return (
                found if found == {u: await served(http, gateway.url, u) for u in users} else None
            )

        before = await eventually(homes, within_s=30, what="keys on the last pod")
        lost = [u for u, port in before.items() if port == last.port]
        await stopped.aclose()

        async def elsewhere() -> dict[str, int] | None:
            """Where the lost keys go, asked twice alike; `served` fails the test on any
            request not answered 200."""
            now = {u: await served(http, gateway.url, u) for u in lost}
            again = {u: await served(http, gateway.url, u) for u in lost}
            return now if now == again and last.port not in now.values() else None

        moved = await eventually(elsewhere, within_s=30, what="the lost keys on other pods")
        assert set(moved.values()) <= {p.port for p in pods}
        # The others' keys stayed.
        kept = {u: await served(http, gateway.url, u) for u in before if u not in lost}
        assert kept == {u: p for u, p in before.items() if u not in lost}


def _table(app: XdsApplication) -> dict[int, int]:
    """Each pinned bucket's pod (by port), as `app` pushes it."""
    pool = app.controller.decision.pools["gpu"]
    return {b: e.port for e in pool.endpoints for b in e.key_buckets}


async def test_a_replica_pins_the_keys_its_peers_envoy_served_and_the_peer_follows(
    tmp_path: Path,
) -> None:
    """Two peered replicas; only the first has an Envoy. The second ("other", whose name
    sorts first) leads: it pins each key's bucket where its peer's Envoy served the key,
    and the first pushes that table as its own."""
    async with contextlib.AsyncExitStack() as stack:
        _, gateway, http = await _bucket_gateway(stack, tmp_path, 3)
        other = await peered_leader(stack, gateway, tmp_path)
        users = [f"user-{n}" for n in range(20)]

        async def alike() -> dict[str, int] | None:
            """Where each key is served, once both replicas push the same table, every
            key's bucket in it, where the key is served."""
            found = {u: await served(http, gateway.url, u) for u in users}
            table = _table(other)
            if table != _table(gateway.app):
                return None
            pinned = all(table.get(key_hash(u) % BUCKETS) == port for u, port in found.items())
            return found if pinned else None

        found = await eventually(alike, within_s=60, what="both replicas pinning alike")
        assert len(set(found.values())) == 3, found
        # The leader's own Envoys logged nothing: the keys and their pods came from its peer.
        assert other.logged_keys.own() == {}
        assert set(other.logged_keys()["gpu"]) == {key_hash(u) for u in users}


async def test_new_keys_that_arrive_together_go_to_the_pods_with_fewest_in_flight(
    tmp_path: Path,
) -> None:
    """Three rounds of three new keys, each sent while the ones before it are still in
    flight (the pods hold them): each round's keys land on three pods. The spares' least
    request scans them all; with two random choices, or a bucket offered to one spare, a
    round lands two keys on one pod about half the time or more. (`new_key_prefill_s` off:
    a round's first requests, logged or not yet, would make the spares depend on timing.)"""
    async with contextlib.AsyncExitStack() as stack:
        pods, gateway, http = await _bucket_gateway(stack, tmp_path, 3, new_key_prefill_s=0)
        await served(http, gateway.url, "warm-up")
        buckets = {key_hash("warm-up") % BUCKETS}
        fresh = (f"user-{n}" for n in range(1_000))
        for _ in range(3):
            for pod in pods:
                pod.released.clear()
                stack.callback(pod.released.set)  # never left holding, even on failure
            before = [pod.arrived for pod in pods]
            arrived_before = sum(before)
            in_flight = []
            for sent in range(1, 4):
                user = next(u for u in fresh if key_hash(u) % BUCKETS not in buckets)
                buckets.add(key_hash(user) % BUCKETS)
                in_flight.append(asyncio.create_task(served(http, gateway.url, user)))
                await eventually(
                    lambda n=sent, b=arrived_before: sum(p.arrived for p in pods) - b == n,
                    within_s=20,
                    what="the new key's request at a pod",
                )
            assert [p.arrived - b for p, b in zip(pods, before, strict=True)] == [1, 1, 1]
            for pod in pods:
                pod.released.set()
            assert sorted(await asyncio.gather(*in_flight)) == sorted(p.port for p in pods)


def _spares(gateway: LocalGateway) -> set[int] | None:
    """The ports of the pods new keys go to, once the Envoy holds the endpoints of the
    server's last decision (None until then)."""
    entry = gateway.app.cache.entry_for("local")
    streams = gateway.app.registry.streams()
    if entry is None or not streams:
        return None
    if streams[0].acked.get("eds") != entry.snapshot.versions[ResourceType.ENDPOINT]:
        return None
    pool = gateway.app.controller.decision.pools["gpu"]
    return {int(e.id.rsplit(":", 1)[1]) for e in pool.endpoints if e.key_spare}


async def test_a_new_key_passes_over_the_pod_prefilling_another_new_key(
    tmp_path: Path,
) -> None:
    """Two pods, one holding a request in flight, neither with a first request of a key
    that counts still (`new_key_prefill_s` passed since the held key's). A new key goes to
    the other (fewest in flight); the next new key, sent while that first request counts,
    goes to the busy pod instead; then both took one, and a third goes back to the pod
    with the fewest in flight. Least request alone would send all three there."""
    window_s = 5.0
    async with contextlib.AsyncExitStack() as stack:
        pods, gateway, http = await _bucket_gateway(stack, tmp_path, 2, new_key_prefill_s=window_s)
        ports = {p.port: p for p in pods}
        busy = ports[await served(http, gateway.url, "held")]
        idle = next(p for p in pods if p is not busy)
        await eventually(lambda: _pinned(gateway, "held"), within_s=20, what="a pin")
        # Until the held key's first request no longer counts, both pods are spares again.
        both = {p.port for p in pods}
        await eventually(lambda: _spares(gateway) == both, within_s=30, what="both spares")
        busy.released.clear()
        stack.callback(busy.released.set)  # never left holding, even on failure
        arrived = busy.arrived
        held = asyncio.create_task(served(http, gateway.url, "held"))
        await eventually(lambda: busy.arrived > arrived, within_s=20, what="the held request")
        users = (f"user-{n}" for n in range(1_000))
        buckets = {key_hash("held") % BUCKETS}

        def fresh() -> str:
            user = next(u for u in users if key_hash(u) % BUCKETS not in buckets)
            buckets.add(key_hash(user) % BUCKETS)
            return user

        assert await served(http, gateway.url, fresh()) == idle.port
        await eventually(
            lambda: _spares(gateway) == {busy.port}, within_s=window_s, what="one spare"
        )
        arrived = busy.arrived
        second = asyncio.create_task(served(http, gateway.url, fresh()))
        await eventually(lambda: busy.arrived > arrived, within_s=20, what="the second new key")
        await eventually(lambda: _spares(gateway) == both, within_s=30, what="both spares again")
        assert await served(http, gateway.url, fresh()) == idle.port
        busy.released.set()
        assert await asyncio.gather(held, second) == [busy.port, busy.port]
