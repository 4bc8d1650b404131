"""Helpers for driving grpcio's own xDS client (proxyless gRPC) against the ADS server.

- Resources shaped the way gRPC's xDS client (gRFC A27 and successors) accepts them: it is
  stricter than Envoy (a typed Router config, a locality weight on every EDS locality, ...).
- Loopback backends: grpc.aio servers with one unary method that answers with their name.
- `XdsClientProcess`: a subprocess that creates an `xds:///` channel and makes one call per
  command it reads on stdin, printing each result as a JSON line. The xDS bootstrap is
  process-global and cached by gRPC, so a fresh process gives each test a fresh bootstrap
  and keeps the pytest process unpolluted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import api_listener_pb2, listener_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf import any_pb2
from google.protobuf.wrappers_pb2 import UInt32Value

from tests.xds import fixtures
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

SERVICE = "xdstest.Backend"
METHOD = f"/{SERVICE}/Who"
NODE_ID = "grpc-client"
NODE_CLUSTER = "test"

ADS = config_source_pb2.ConfigSource(
    ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3
)


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


# -- Resources -------------------------------------------------------------------------------


def grpc_listener(name: str, route_name: str) -> listener_pb2.Listener:
    """An api_listener: HCM with RDS over ADS, ending with a *typed* router filter."""
    hcm = hcm_pb2.HttpConnectionManager(
        rds=hcm_pb2.Rds(config_source=ADS, route_config_name=route_name),
        http_filters=[
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.router", typed_config=_pack(router_pb2.Router())
            )
        ],
    )
    return listener_pb2.Listener(
        name=name, api_listener=api_listener_pb2.ApiListener(api_listener=_pack(hcm))
    )


def grpc_cluster(name: str) -> cluster_pb2.Cluster:
    """An EDS cluster (endpoints over ADS) with ROUND_ROBIN, which gRPC supports."""
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=ADS, service_name=name),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
    )


def grpc_assignment(name: str, ports: Sequence[int]) -> endpoint_pb2.ClusterLoadAssignment:
    """One weighted locality of 127.0.0.1 endpoints (gRPC drops localities without a weight)."""
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                locality=base_pb2.Locality(region="local", zone="a"),
                load_balancing_weight=UInt32Value(value=1),
                lb_endpoints=[
                    endpoint_components_pb2.LbEndpoint(
                        endpoint=endpoint_components_pb2.Endpoint(
                            address=address_pb2.Address(
                                socket_address=address_pb2.SocketAddress(
                                    address="127.0.0.1", port_value=port
                                )
                            )
                        ),
                        health_status=health_check_pb2.HEALTHY,
                        load_balancing_weight=UInt32Value(value=1),
                    )
                    for port in ports
                ],
            )
        ],
    )


def grpc_snapshot(
    listener: str,
    cluster: str,
    ports: Sequence[int],
    *,
    make_listener: Callable[[str, str], listener_pb2.Listener] = grpc_listener,
) -> Snapshot:
    """Listener -> route `route-<listener>` -> EDS cluster -> endpoints on `ports`."""
    route = f"route-{listener}"
    return Snapshot.build(
        {
            ResourceType.LISTENER: [make_listener(listener, route)],
            ResourceType.ROUTE: [fixtures.route_config(route, cluster)],
            ResourceType.CLUSTER: [grpc_cluster(cluster)],
            ResourceType.ENDPOINT: [grpc_assignment(cluster, ports)],
        }
    )


def bootstrap(ads_target: str) -> str:
    return json.dumps(
        {
            "xds_servers": [
                {
                    "server_uri": ads_target,
                    "channel_creds": [{"type": "insecure"}],
                    "server_features": ["xds_v3"],
                }
            ],
            "node": {"id": NODE_ID, "cluster": NODE_CLUSTER},
        }
    )


# -- Backends --------------------------------------------------------------------------------


@dataclass
class Backend:
    """A loopback gRPC server whose one method answers with its name."""

    name: str
    server: grpc.aio.Server
    port: int = 0
    hits: int = 0
    peers: list[str] = field(default_factory=list)

    async def stop(self) -> None:
        await self.server.stop(grace=None)


async def start_backend(name: str) -> Backend:
    server = grpc.aio.server()
    backend = Backend(name=name, server=server)

    async def who(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        backend.hits += 1
        backend.peers.append(context.peer())
        return backend.name.encode()

    # No serializers: the method takes and returns raw bytes.
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Who": grpc.unary_unary_rpc_method_handler(who)}
            ),
        )
    )
    backend.port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return backend


# -- The xDS client subprocess ---------------------------------------------------------------

# Reads one command per stdin line: "call <timeout-seconds>" makes one RPC through the xDS
# channel and prints {"ok": true, "backend": ...} or {"ok": false, "code": ..., "details": ...}.
# The channel is lazy: gRPC's xDS client opens its ADS stream only at the first call.
CLIENT_SCRIPT = f"""
import json, sys
import grpc

channel = grpc.insecure_channel(sys.argv[1])
who = channel.unary_unary({METHOD!r})
print(json.dumps({{"ready": True}}), flush=True)
for line in sys.stdin:
    command, _, argument = line.strip().partition(" ")
    if command != "call":
        break
    try:
        reply = who(b"", timeout=float(argument), wait_for_ready=True)
        result = {{"ok": True, "backend": reply.decode()}}
    except grpc.RpcError as error:
        result = {{"ok": False, "code": error.code().name, "details": error.details()}}
    print(json.dumps(result), flush=True)
channel.close()
"""


class XdsClientProcess:
    """A Python subprocess holding one `xds:///<listener>` channel, bootstrapped at `ads_target`."""

    def __init__(self, process: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self._process = process
        self.stderr_path = stderr_path

    @classmethod
    async def start(
        cls, ads_target: str, listener: str, *, stderr_path: Path, trace: bool = False
    ) -> XdsClientProcess:
        env = dict(os.environ)
        env.pop("GRPC_XDS_BOOTSTRAP", None)
        env["GRPC_XDS_BOOTSTRAP_CONFIG"] = bootstrap(ads_target)
        if trace:
            env["GRPC_TRACE"] = "xds_client,xds_resolver,cds_lb,xds_cluster_impl_lb"
            env["GRPC_VERBOSITY"] = "DEBUG"
        with stderr_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CLIENT_SCRIPT,
                f"xds:///{listener}",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=env,
            )
        client = cls(process, stderr_path)
        try:
            hello = await client._read_line(seconds=10.0)
            assert hello == {"ready": True}, hello
        except BaseException:
            await client.close()
            raise
        return client

    async def _read_line(self, *, seconds: float) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = await asyncio.wait_for(self._process.stdout.readline(), seconds)
        if not line:
            raise RuntimeError(f"xDS client process exited; stderr:\n{self.stderr_tail()}")
        result: dict[str, Any] = json.loads(line)
        return result

    async def call(self, *, rpc_timeout: float = 2.0) -> dict[str, Any]:
        """One RPC through the xDS channel, waiting up to `rpc_timeout` s for it to be ready."""
        assert self._process.stdin is not None
        self._process.stdin.write(f"call {rpc_timeout}\n".encode())
        await self._process.stdin.drain()
        return await self._read_line(seconds=rpc_timeout + 5.0)

    def stderr_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no stderr)"

    async def close(self) -> None:
        process = self._process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), 5.0)
