"""A pool's remote through a real Envoy 1.40 (static resources from the same builders):
a request whose local pod refuses is retried on the remote priority, over TLS with the
remote's SNI and CA, and served there."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.envoy.static_bootstrap import static_bootstrap
from xds_server.config import RoutingConfig
from xds_server.envoy import names
from xds_server.policy.decision import Decision
from xds_server.policy.failover import PoolFailover, RemoteTarget
from xds_testbed import BACKEND_ID_HEADER, EnvoyProcess
from xds_testbed.certs import CertificateAuthority
from xds_testbed.server_process import free_port

REMOTE_NAME = "gw.east.test"


@pytest.fixture
async def tls_remote(tmp_path: Path) -> AsyncIterator[tuple[int, Path]]:
    """An OpenAI-style chat server over TLS for REMOTE_NAME; its port and CA file."""
    issued = CertificateAuthority().issue(tmp_path / "east", dns=[REMOTE_NAME])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(issued.cert, issued.key)

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        body = {"choices": [{"message": {"role": "assistant", "content": "east"}}]}
        return web.json_response(body, headers={BACKEND_ID_HEADER: "east"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    try:
        yield int(runner.addresses[0][1]), issued.ca
    finally:
        await runner.cleanup()


async def test_a_refused_local_request_is_served_by_the_remote_over_tls(
    tls_remote: tuple[int, Path],
) -> None:
    port, ca = tls_remote
    listener_port = free_port()
    config = RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": listener_port},
            "pools": [
                {
                    "name": "gpu",
                    "models": ["m"],
                    "gpu_aware": False,
                    # Nothing listens here: every local attempt is refused.
                    "endpoints": [{"address": "127.0.0.1", "port": free_port()}],
                    "remotes": [
                        {"name": "east", "address": "127.0.0.1", "port": port,
                         "tls": {"sni": REMOTE_NAME, "ca_file": str(ca)}},
                    ],
                }
            ],
        }
    )  # fmt: skip
    target = RemoteTarget(
        remote="east", address="127.0.0.1", port=port, weight=100, usable=True, tls_match="east"
    )
    decision = Decision(failover={"gpu": PoolFailover(share=1.0, targets=(target,))})
    async with EnvoyProcess(static_bootstrap(config, decision), log_level="error") as envoy:
        await envoy.wait_live(timeout=30)
        assert await envoy.listener_port(names.LISTENER_NAME) == listener_port
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(
                    f"http://127.0.0.1:{listener_port}/v1/chat/completions",
                    json={"model": "m", "messages": []},
                ) as response:
                    assert response.status == 200, await response.text()
                    assert response.headers[BACKEND_ID_HEADER] == "east"
        stats = await envoy.get_stats(r"cluster\.gpu\.(ssl\.handshake|upstream_rq_retry$)")
    assert stats["cluster.gpu.ssl.handshake"] >= 1
    assert stats["cluster.gpu.upstream_rq_retry"] >= 1
