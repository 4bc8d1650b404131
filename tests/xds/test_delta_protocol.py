"""Delta (incremental) ADS over a real gRPC channel, driven by a scripted client."""

from __future__ import annotations

from google.rpc import status_pb2

from tests.xds import fixtures
from xds_server.xds.resources import ResourceType

CDS = ResourceType.CLUSTER.url
EDS = ResourceType.ENDPOINT.url

POOLS = {"a": [("10.0.0.1", 80, 1)], "b": [("10.0.0.2", 80, 1)]}


def names(response) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.name for r in response.resources]


async def test_wildcard_then_only_changes_and_removals(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients(delta=True)
    await client.send(CDS)
    first = await client.recv()
    assert sorted(names(first)) == ["a", "b"] and not first.removed_resources
    assert all(r.version for r in first.resources)
    await client.send(CDS, response_nonce=first.nonce)
    # Only "b" changes and "c" appears: the response carries just those two.
    pools = {"a": POOLS["a"], "b": POOLS["b"], "c": [("10.0.0.3", 80, 1)]}
    ads.cache.set_snapshot(fixtures.snapshot(pools, connect_timeout_ms=1000))
    second = await client.recv()
    assert names(second) == ["c"]
    await client.send(CDS, response_nonce=second.nonce)
    ads.cache.set_snapshot(fixtures.snapshot({"c": pools["c"]}))
    third = await client.recv()
    assert names(third) == [] and sorted(third.removed_resources) == ["a", "b"]


async def test_subscribe_and_unsubscribe(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients(delta=True)
    await client.send(EDS, resource_names_subscribe=["a"])
    first = await client.recv()
    assert names(first) == ["a"]
    await client.send(EDS, response_nonce=first.nonce, resource_names_subscribe=["b"])
    second = await client.recv()
    assert names(second) == ["b"]
    await client.send(EDS, response_nonce=second.nonce, resource_names_unsubscribe=["a"])
    # "a" changes after the unsubscribe: nothing is sent for it.
    ads.cache.set_snapshot(fixtures.snapshot({**POOLS, "a": [("10.0.0.7", 80, 2)]}))
    await client.expect_silence(0.2)
    # Subscribing again sends the current "a".
    await client.send(EDS, resource_names_subscribe=["a"])
    assert names(await client.recv()) == ["a"]


async def test_removed_resource_of_named_subscription(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients(delta=True)
    await client.send(EDS, resource_names_subscribe=["a", "b"])
    first = await client.recv()
    await client.send(EDS, response_nonce=first.nonce)
    ads.cache.set_snapshot(fixtures.snapshot({"a": POOLS["a"]}))
    second = await client.recv()
    assert list(second.removed_resources) == ["b"] and names(second) == []


async def test_reconnect_with_initial_versions_sends_only_what_differs(ads, clients) -> None:  # type: ignore[no-untyped-def]
    snap = fixtures.snapshot(POOLS)
    ads.cache.set_snapshot(snap)
    known = {name: r.version for name, r in snap.resources[ResourceType.CLUSTER].items()}
    client = clients(delta=True)
    await client.send(CDS, initial_resource_versions=known)
    await client.expect_silence(0.2)
    other = clients(delta=True)
    await other.send(CDS, initial_resource_versions={"a": known["a"], "gone": "v0"})
    response = await other.recv()
    assert names(response) == ["b"] and list(response.removed_resources) == ["gone"]


async def test_stale_nonce_still_applies_subscriptions(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients(delta=True)
    await client.send(EDS, resource_names_subscribe=["a"])
    first = await client.recv()
    await client.send(EDS, response_nonce="not-a-nonce-we-sent", resource_names_subscribe=["b"])
    await client.expect_silence(0.2)  # "a" is still unacknowledged, so "b" waits
    assert ads.metric("xds_stale_nonces_total", type="eds") == 1
    await client.send(EDS, response_nonce=first.nonce)
    assert names(await client.recv()) == ["b"]


async def test_nack_keeps_last_good_and_waits_for_change(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients(delta=True)
    await client.send(CDS)
    good = await client.recv()
    await client.send(CDS, response_nonce=good.nonce)
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, connect_timeout_ms=7))
    bad = await client.recv()
    await client.send(
        CDS, response_nonce=bad.nonce, error_detail=status_pb2.Status(code=3, message="nope")
    )
    await client.expect_silence(0.2)
    assert ads.metric("xds_nacks_total", type="cds") == 1
    [record] = ads.registry.streams()
    assert record.protocol == "delta" and record.acked["cds"] == good.system_version_info
    assert record.last_nack is not None and record.last_nack.error == "nope"


async def test_cluster_change_resends_its_assignment_right_after_the_clusters(ads, clients) -> None:  # type: ignore[no-untyped-def]
    """Envoy already subscribes to an updated cluster's assignment, so it asks for
    nothing, and it ACKs the clusters only once they have warmed: held until that ACK, the
    assignment came at Envoy's initial_fetch_timeout (15 s) instead."""
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients(delta=True)
    await client.send(CDS)
    cds = await client.recv()
    await client.send(EDS, resource_names_subscribe=["a", "b"])
    eds = await client.recv()
    await client.send(CDS, response_nonce=cds.nonce)
    await client.send(EDS, response_nonce=eds.nonce)
    await client.expect_silence(0.2)
    ads.cache.set_snapshot(fixtures.snapshot({**POOLS, "a": POOLS["a"]}, connect_timeout_ms=4000))
    cds2 = await client.recv()
    assert sorted(names(cds2)) == ["a", "b"]
    eds2 = await client.recv()  # no ACK of the clusters, no request for endpoints
    assert eds2.type_url == EDS and sorted(names(eds2)) == ["a", "b"]
