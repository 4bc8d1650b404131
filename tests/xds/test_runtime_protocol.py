"""RTDS on the ADS stream: the runtime layer is requested by name, pushed, ACKed and NACKed.

Envoy asks for each `rtds_layer` of its bootstrap by name (SotW `resource_names`, Delta
`resource_names_subscribe`), before it starts CDS; the server sends runtime first in ADS
order, and a runtime-only change sends nothing else.
"""

from __future__ import annotations

from envoy.service.runtime.v3 import rtds_pb2
from google.rpc import status_pb2

from tests.xds import fixtures
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import content_hash

RTDS = ResourceType.RUNTIME.url
CDS = ResourceType.CLUSTER.url
LAYER = fixtures.RUNTIME_LAYER
POOLS = {"a": [("10.0.0.1", 80, 1)]}
KEY = "circuit_breakers.a/critical.default.max_requests"


def layers(response) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    """The Runtime resources of a SotW or Delta response, by name."""
    out = {}
    for item in response.resources:
        packed = item.resource if hasattr(item, "resource") else item
        runtime = rtds_pb2.Runtime()
        assert packed.Unpack(runtime)
        out[runtime.name] = dict(runtime.layer)
    return out


async def test_sotw_named_runtime_layer_is_pushed_alone_when_only_it_changes(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, runtime_layer={KEY: 4}))
    client = clients()
    await client.send(RTDS, resource_names=[LAYER])
    first = await client.recv()
    assert first.type_url == RTDS and layers(first) == {LAYER: {KEY: 4}}
    await client.send(
        RTDS, resource_names=[LAYER], version_info=first.version_info, response_nonce=first.nonce
    )
    await client.send(CDS)
    cds = await client.recv()
    await client.send(CDS, version_info=cds.version_info, response_nonce=cds.nonce)
    await client.expect_silence(0.2)

    # A new limit: RTDS only; clusters are not re-sent.
    assert ads.cache.set_snapshot(fixtures.snapshot(POOLS, runtime_layer={KEY: 9}))
    second = await client.recv()
    assert second.type_url == RTDS and layers(second) == {LAYER: {KEY: 9}}
    assert second.version_info != first.version_info
    await client.send(
        RTDS, resource_names=[LAYER], version_info=second.version_info, response_nonce=second.nonce
    )
    await client.expect_silence(0.2)
    assert ads.metric("xds_responses_total", type="cds") == 1
    assert ads.metric("xds_acks_total", type="rtds") == 2
    [record] = ads.registry.streams()
    assert record.acked["rtds"] == second.version_info


async def test_sotw_runtime_goes_out_before_clusters(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, runtime_layer={KEY: 1}))
    client = clients()
    await client.send(CDS)
    cds = await client.recv()
    await client.send(CDS, version_info=cds.version_info, response_nonce=cds.nonce)
    await client.send(RTDS, resource_names=[LAYER])
    rtds = await client.recv()
    await client.send(
        RTDS, resource_names=[LAYER], version_info=rtds.version_info, response_nonce=rtds.nonce
    )
    # Both ACKed (an unacknowledged type waits for its ACK, whatever its place in the order).
    await ads.registry.wait_for_ack("rtds", rtds.version_info)
    await ads.registry.wait_for_ack("cds", cds.version_info)
    # A new band cluster and its limit in one snapshot: the limit arrives first.
    ads.cache.set_snapshot(
        fixtures.snapshot({**POOLS, "b": [("10.0.0.2", 80, 1)]}, runtime_layer={KEY: 2})
    )
    assert [(await client.recv()).type_url, (await client.recv()).type_url] == [RTDS, CDS]


async def test_sotw_runtime_nack_is_counted_and_not_resent(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, runtime_layer={KEY: 1}))
    client = clients()
    await client.send(RTDS, resource_names=[LAYER])
    good = await client.recv()
    await client.send(
        RTDS, resource_names=[LAYER], version_info=good.version_info, response_nonce=good.nonce
    )
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, runtime_layer={KEY: -1}))
    bad = await client.recv()
    await client.send(
        RTDS,
        resource_names=[LAYER],
        version_info=good.version_info,
        response_nonce=bad.nonce,
        error_detail=status_pb2.Status(code=3, message="bad runtime value"),
    )
    await client.expect_silence(0.2)
    assert ads.metric("xds_nacks_total", type="rtds") == 1
    [record] = ads.registry.streams()
    assert record.acked["rtds"] == good.version_info
    assert record.last_nack is not None and record.last_nack.type == "rtds"
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, runtime_layer={KEY: 3}))
    assert layers(await client.recv()) == {LAYER: {KEY: 3}}


async def test_sotw_snapshot_without_runtime_answers_an_empty_response(ads, clients) -> None:  # type: ignore[no-untyped-def]
    # No Runtime resource: the (empty) type is still answered, as EDS would be, so a client
    # is never left waiting; Envoy NACKs an empty RTDS response and starts without the layer.
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    client = clients()
    await client.send(RTDS, resource_names=[LAYER])
    response = await client.recv()
    assert response.type_url == RTDS and not response.resources
    assert response.version_info == content_hash()


async def test_delta_named_runtime_layer_push_ack_and_nack(ads, clients) -> None:  # type: ignore[no-untyped-def]
    ads.cache.set_snapshot(fixtures.snapshot(POOLS, runtime_layer={KEY: 4}))
    client = clients(delta=True)
    await client.send(RTDS, resource_names_subscribe=[LAYER])
    first = await client.recv()
    assert first.type_url == RTDS and layers(first) == {LAYER: {KEY: 4}}
    [resource] = first.resources
    assert resource.name == LAYER and resource.version
    await client.send(RTDS, response_nonce=first.nonce)
    await client.send(CDS)
    cds = await client.recv()
    await client.send(CDS, response_nonce=cds.nonce)

    ads.cache.set_snapshot(fixtures.snapshot(POOLS, runtime_layer={KEY: 6}))
    second = await client.recv()
    assert second.type_url == RTDS and layers(second) == {LAYER: {KEY: 6}}
    await client.send(
        RTDS,
        response_nonce=second.nonce,
        error_detail=status_pb2.Status(code=3, message="bad runtime value"),
    )
    await client.expect_silence(0.2)
    assert ads.metric("xds_acks_total", type="rtds") == 1
    assert ads.metric("xds_nacks_total", type="rtds") == 1
    assert ads.metric("xds_responses_total", type="cds") == 1
    # The layer disappears from the snapshot: Delta says it was removed.
    ads.cache.set_snapshot(fixtures.snapshot(POOLS))
    third = await client.recv()
    assert third.type_url == RTDS and list(third.removed_resources) == [LAYER]
