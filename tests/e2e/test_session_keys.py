"""The session-key log through a real Envoy (xds/session_keys.py): each keyed request's
upstream stream is logged once, batched, with its session header; the server keeps the
key's hash and the pod that served it, and unkeyed requests are not logged."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp

from tests.e2e.conftest import eventually
from tests.e2e.session_pods import Pod, session_gateway
from tests.e2e.session_pods import served as serving_pod
from xds_server.xds.session_keys import key_hash

KEYS = [f"user-{i}" for i in range(8)]
SENDS = 3


async def _unkeyed(http: aiohttp.ClientSession, url: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def test_the_server_holds_the_hashes_of_the_keys_sent_and_the_pods_that_served_them(
    tmp_path: Path,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(Pod().serving()) for _ in range(3)]
        gateway, http = await session_gateway(stack, pods, tmp_path)
        registry = gateway.app.telemetry.registry
        homes: dict[str, int] = {}
        # Unkeyed first: on the one connection (one Envoy worker, one log buffer), the
        # last keyed entry arrives after any entry of theirs would have.
        for _ in range(SENDS):
            await _unkeyed(http, gateway.url)
            for key in KEYS:
                homes[key] = await serving_pod(http, gateway.url, key)

        def taken() -> float:
            return registry.get_sample_value("xds_session_key_entries_total") or 0.0

        await eventually(lambda: taken() >= SENDS * len(KEYS), what="the keyed requests logged")
        snapshot = gateway.app.session_keys.snapshot()
        assert set(snapshot) == {"gpu"}
        keys = snapshot["gpu"]
        assert {h: seen.endpoint for h, seen in keys.items()} == {
            key_hash(k): f"127.0.0.1:{port}" for k, port in homes.items()
        }
        # One entry per request (not one per stream event), decayed a little since.
        assert all(SENDS * 0.9 < seen.count <= SENDS for seen in keys.values()), keys
        assert taken() == SENDS * len(KEYS)
        assert registry.get_sample_value(
            "xds_session_key_dropped_entries_total", {"reason": "no_key"}
        ) in (None, 0.0)
        assert registry.get_sample_value("xds_session_keys", {"pool": "gpu"}) == len(KEYS)
