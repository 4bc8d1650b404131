"""Servers of different clusters over real gRPC on loopback: one asks another for its
pools (service.POOLS_HELLO) and gets their summaries, while the same server still sends
its Envoys' load to a replica that asks the old way (without `pools`, which a replica
that predates it would refuse); a server that predates the summaries answers with its
Envoys' load, which reads as no summary. DNS names of remotes are looked up."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import CollectorRegistry

from tests.e2e.conftest import eventually
from tests.peering.test_links import REPORT
from xds_server.config import RoutingConfig
from xds_server.peering.links import PeerLinks
from xds_server.peering.remote_clusters import RemoteClusters
from xds_server.peering.reports import PoolReport, ReplicaReport
from xds_server.peering.service import PeeringServer

POOLS = ReplicaReport(
    replica="b",
    pools={"gpu": PoolReport(healthy=0, endpoints=2, saturation=None, capacity=0)},
)


async def _serve(handler: grpc.GenericRpcHandler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _config(new: str, old: str) -> RoutingConfig:
    return RoutingConfig.model_validate(
        {
            "pools": [
                {
                    "name": "gpu",
                    "models": ["m"],
                    "remotes": [
                        {"name": "new", "address": "localhost", "port": 8080, "peer": new},
                        {"name": "old", "address": "192.0.2.7", "port": 8080, "peer": old},
                        {"name": "blind", "address": "192.0.2.8", "port": 8080},
                    ],
                }
            ]
        }
    )


async def test_pools_are_asked_for_and_old_servers_are_used_blind() -> None:
    new, new_address = await _serve(
        PeeringServer(report=lambda: REPORT, pools=lambda: POOLS).generic_handler()
    )
    old, old_address = await _serve(PeeringServer(report=lambda: REPORT).generic_handler())
    remotes = RemoteClusters(replica="a", registry=CollectorRegistry(), resolve_interval_s=60)
    replica = PeerLinks(replica="a2", registry=CollectorRegistry())
    config = _config(new_address, old_address)
    remotes.follow(config)
    runner = asyncio.create_task(remotes.run())
    try:

        def views() -> dict[str, object]:
            return dict(remotes.views(config)["gpu"])

        await eventually(
            lambda: views()["new"].summary is not None  # type: ignore[attr-defined]
            and views()["old"].linked  # type: ignore[attr-defined]
            and views()["new"].addresses,  # type: ignore[attr-defined]
            what="both remote servers linked, localhost looked up",
        )
        seen = views()
        assert seen["new"].summary.healthy == 0  # type: ignore[attr-defined]
        assert "127.0.0.1" in seen["new"].addresses  # type: ignore[attr-defined]
        # An old server sends its Envoys' load: linked, but no summary.
        assert seen["old"].summary is None  # type: ignore[attr-defined]
        assert seen["old"].addresses == ("192.0.2.7",)  # type: ignore[attr-defined]
        assert seen["blind"].linked is None  # type: ignore[attr-defined]
        # A replica of the new server's own cluster still gets the Envoys' load.
        replica.set_peers([new_address])
        await eventually(lambda: replica.reports(), what="the replica's report")
        assert [r for r, _ in replica.reports()] == [REPORT]
    finally:
        runner.cancel()
        await remotes.close()
        await replica.close()
        await new.stop(None)
        await old.stop(None)
