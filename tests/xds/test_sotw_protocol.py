"""SotW ADS over a real gRPC channel, driven by a scripted client."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from google.rpc import status_pb2

from tests.xds import fixtures
from xds_server.xds.resources import ResourceType

CDS = ResourceType.CLUSTER.url
EDS = ResourceType.ENDPOINT.url
LDS = ResourceType.LISTENER.url
RDS = ResourceType.ROUTE.url

POOLS = {"a": [("10.0.0.1", 80, 1)], "b": [("10.0.0.2", 80, 1)]}


def names(response) -> list[str]:  # type: ignore[no-untyped-def]
    out = []
    for packed in response.resources:
        if packed.type_url == CDS:
            message = cluster_pb2.Cluster()
            packed.Unpack(message)
            out.append(message.name)
        else:
            assignment = endpoint_pb2.ClusterLoadAssignment()
            packed.Unpack(assignment)
            out.append(assignment.cluster_name)
    return out


async def test_wildcard_cds_then_named_eds_and_ack(ads, clients) -> None:  # type: ignore[no-untyped-def]
    snap = fixtures.snapshot(POOLS)
    ads.cache.set_snapshot(snap)
    client = clients()
    await client.send(CDS)
    cds = await client.recv()
    assert cds.type_url == CDS and sorted(names(cds)) == ["a", "b"]
    assert cds.version_info == snap.versions[ResourceType.CLUSTER] and cds.nonce
    # EDS is answered before CDS is acknowledged (Envoy asks for it first).
    await client.send(EDS, resource_names=["a"])
    eds = await client.recv()
    assert names(eds) == ["a"]
    await client.send(CDS, version_info=cds.version_info, response_nonce=cds.nonce)
    await client.send(
        EDS, version_info=eds.version_info, resource_names=["a"], response_nonce=eds.nonce
    )
    await client.expect_silence()
    assert ads.metric("xds_acks_total", type="cds") == 1
    assert ads.metric("xds_acks_total", type="eds") == 1
    [record] = ads.registry.streams()
    assert record.acked == {"cds": cds.version_info, "eds": eds.version_info}
    assert record.node_id == "test-node"


async def test_waits_for_a_snapshot(ads, clients) -> None:  # type: ignore[no-untyped-def]
    client = clients()
    await client.send(CDS)
    await client.expect_silence(0.2)
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    assert sorted(names(await client.recv())) == ["a", "b"]


async def test_change_is_pushed_only_after_ack_and_only_when_content_changes(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(EDS, resource_names=["a", "b"])
    first = await client.recv()
    # A change to "b" while the response is unacknowledged waits for the ACK.
    assert ads.cache.set_snapshot(fixtures.snapshot({**POOLS, "b": [("10.0.0.3", 80, 1)]}))
    await client.expect_silence(0.2)
    await client.send(
        EDS, resource_names=["a", "b"], version_info=first.version_info, response_nonce=first.nonce
    )
    second = await client.recv()
    assert second.version_info != first.version_info
    await client.send(
        EDS,
        resource_names=["a", "b"],
        version_info=second.version_info,
        response_nonce=second.nonce,
    )
    # Same content again: nothing is sent (and the cache reports no change).
    assert not ads.cache.set_snapshot(fixtures.snapshot({**POOLS, "b": [("10.0.0.3", 80, 1)]}))
    await client.expect_silence(0.2)


async def test_named_subscription_ignores_other_resources(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(EDS, resource_names=["a"])
    first = await client.recv()
    await client.send(
        EDS, resource_names=["a"], version_info=first.version_info, response_nonce=first.nonce
    )
    ads.cache.set_snapshot(fixtures.snapshot({**POOLS, "b": [("10.0.0.9", 80, 1)]}))
    await client.expect_silence(0.2)
    # Subscribing to a new name is answered at once, with just that name: an EDS response
    # carries only what the client does not hold yet ("a" is held, and named twice).
    await client.send(
        EDS,
        resource_names=["a", "b", "a"],
        version_info=first.version_info,
        response_nonce=first.nonce,
    )
    assert names(await client.recv()) == ["b"]


async def test_stale_nonce_is_ignored(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(CDS)
    first = await client.recv()
    await client.send(CDS, version_info=first.version_info, response_nonce=first.nonce)
    ads.cache.set_snapshot(fixtures.snapshot({"a": POOLS["a"]}))
    second = await client.recv()
    assert names(second) == ["a"]
    # An ACK echoing the first nonce is stale: it neither acknowledges nor triggers anything.
    await client.send(CDS, version_info=first.version_info, response_nonce=first.nonce)
    await client.expect_silence(0.2)
    assert ads.metric("xds_stale_nonces_total", type="cds") == 1
    [record] = ads.registry.streams()
    assert record.acked["cds"] == first.version_info


async def test_nack_is_recorded_and_not_resent(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(CDS)
    good = await client.recv()
    await client.send(CDS, version_info=good.version_info, response_nonce=good.nonce)
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, connect_timeout_ms=5))
    bad = await client.recv()
    await client.send(
        CDS,
        version_info=good.version_info,
        response_nonce=bad.nonce,
        error_detail=status_pb2.Status(code=3, message="connect_timeout too small"),
    )
    await client.expect_silence(0.2)
    assert ads.metric("xds_nacks_total", type="cds") == 1
    [record] = ads.registry.streams()
    assert record.acked["cds"] == good.version_info
    assert record.last_nack is not None and record.last_nack.error == "connect_timeout too small"
    assert record.last_nack.version == bad.version_info
    # The next change is sent.
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, connect_timeout_ms=2000))
    assert (await client.recv()).version_info not in (good.version_info, bad.version_info)


async def test_reconnect_with_known_version_is_not_resent(ads, clients) -> None:  # type: ignore[no-untyped-def]
    snap = fixtures.snapshot(POOLS)
    ads.cache.set_snapshot(snap)
    client = clients()
    await client.send(CDS, version_info=snap.versions[ResourceType.CLUSTER])
    await client.expect_silence(0.2)
    other = clients()
    await other.send(CDS, version_info="some-old-version")
    assert sorted(names(await other.recv())) == ["a", "b"]


async def test_removed_cluster_disappears_from_wildcard_response(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(CDS)
    first = await client.recv()
    await client.send(CDS, version_info=first.version_info, response_nonce=first.nonce)
    ads.cache.set_snapshot(fixtures.snapshot({"b": POOLS["b"]}))
    assert names(await client.recv()) == ["b"]


async def test_cluster_change_resends_unchanged_endpoints_in_ads_order(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(CDS)
    cds = await client.recv()
    await client.send(EDS, resource_names=["a", "b"])
    eds = await client.recv()
    await client.send(CDS, version_info=cds.version_info, response_nonce=cds.nonce)
    await client.send(
        EDS, resource_names=["a", "b"], version_info=eds.version_info, response_nonce=eds.nonce
    )
    await client.expect_silence(0.2)
    # Clusters change, endpoints do not: CDS goes out, EDS waits for Envoy's EDS request...
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, connect_timeout_ms=3000))
    cds2 = await client.recv()
    assert cds2.type_url == CDS
    await client.expect_silence(0.2)
    # ...which it answers with the full, unchanged assignment set.
    await client.send(
        EDS, resource_names=["a", "b"], version_info=eds.version_info, response_nonce=eds.nonce
    )
    eds2 = await client.recv()
    assert eds2.type_url == EDS and names(eds2) == ["a", "b"]
    assert eds2.version_info == eds.version_info


async def test_eds_resent_after_cds_ack_when_envoy_does_not_ask(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(CDS)
    cds = await client.recv()
    await client.send(EDS, resource_names=["a"])
    eds = await client.recv()
    await client.send(CDS, version_info=cds.version_info, response_nonce=cds.nonce)
    await client.send(
        EDS, resource_names=["a"], version_info=eds.version_info, response_nonce=eds.nonce
    )
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, connect_timeout_ms=3000))
    cds2 = await client.recv()
    await client.send(CDS, version_info=cds2.version_info, response_nonce=cds2.nonce)
    assert names(await client.recv()) == ["a"]


async def test_listener_then_route(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, listeners={"l1": "a"}))
    client = clients()
    await client.send(LDS, resource_names=["l1"])
    lds = await client.recv()
    assert lds.type_url == LDS and len(lds.resources) == 1
    await client.send(RDS, resource_names=["route-l1"])
    rds = await client.recv()
    assert rds.type_url == RDS and len(rds.resources) == 1


async def test_unknown_type_is_counted_not_answered(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send("type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret")
    await client.expect_silence(0.2)
    assert ads.metric("xds_unknown_type_requests_total") == 1


async def test_streams_are_tracked_and_released(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(CDS)
    await client.recv()
    assert ads.metric("xds_connected_streams", protocol="sotw") == 1
    await client.close()
    for _ in range(50):
        if not ads.registry.streams():
            break
        import asyncio

        await asyncio.sleep(0.02)
    assert ads.registry.streams() == []
    assert ads.metric("xds_connected_streams", protocol="sotw") == 0


async def _subscribed(ads, clients, pools):  # type: ignore[no-untyped-def]
    """A client holding `pools`' clusters and assignments, everything ACKed."""
    ads.cache.set_snapshot(fixtures.snapshot(pools))
    client = clients()
    await client.send(CDS)
    cds = await client.recv()
    await client.send(EDS, resource_names=sorted(pools))
    eds = await client.recv()
    assert names(eds) == sorted(pools)
    await client.send(CDS, version_info=cds.version_info, response_nonce=cds.nonce)
    await client.send(
        EDS, resource_names=sorted(pools), version_info=eds.version_info, response_nonce=eds.nonce
    )
    await client.expect_silence(0.2)
    return client, eds


async def test_an_eds_response_carries_only_the_changed_assignments(ads, clients) -> None:  # type: ignore[no-untyped-def]
    pools = {**POOLS, "c": [("10.0.0.3", 80, 1)]}
    client, eds = await _subscribed(ads, clients, pools)
    ads.cache.set_snapshot(fixtures.snapshot({**pools, "b": [("10.0.0.2", 80, 7)]}))
    changed = await client.recv()
    assert changed.type_url == EDS and names(changed) == ["b"]
    assert changed.version_info != eds.version_info
    # Acknowledged: the client now holds the new version of everything; nothing more.
    await client.send(
        EDS,
        resource_names=sorted(pools),
        version_info=changed.version_info,
        response_nonce=changed.nonce,
    )
    await client.expect_silence(0.2)


async def test_a_changed_cluster_gets_its_own_assignment_again_and_only_that(ads, clients) -> None:  # type: ignore[no-untyped-def]
    pools = {**POOLS, "c": [("10.0.0.3", 80, 1)]}
    client, eds = await _subscribed(ads, clients, pools)
    clusters = [fixtures.cluster(n, connect_timeout_ms=3000 if n == "b" else 1000) for n in pools]
    ads.cache.set_snapshot(fixtures.snapshot(pools).replace(ResourceType.CLUSTER, clusters))
    cds = await client.recv()
    assert cds.type_url == CDS and names(cds) == ["a", "b", "c"]  # CDS stays complete
    await client.send(
        EDS, resource_names=sorted(pools), version_info=eds.version_info, response_nonce=eds.nonce
    )
    resent = await client.recv()
    assert resent.type_url == EDS and names(resent) == ["b"]
    assert resent.version_info == eds.version_info


async def test_a_name_asked_for_again_is_sent_again(ads, clients) -> None:  # type: ignore[no-untyped-def]
    """Partial EDS responses track what the client holds by name; a name it stopped asking
    for is forgotten, so asking again gets the assignment again, unchanged or not."""
    client, eds = await _subscribed(ads, clients, POOLS)
    await client.send(
        EDS, resource_names=["a"], version_info=eds.version_info, response_nonce=eds.nonce
    )
    await client.expect_silence(0.2)
    await client.send(
        EDS, resource_names=["a", "b"], version_info=eds.version_info, response_nonce=eds.nonce
    )
    again = await client.recv()
    assert again.type_url == EDS and names(again) == ["b"]
