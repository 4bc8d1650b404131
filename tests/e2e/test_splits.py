"""Weighted splits between model names (canary), applied by a real Envoy."""

from __future__ import annotations

import asyncio

from tests.e2e.conftest import chat, eventually, served_by
from xds_server.envoy import names


async def test_split_follows_weights_and_changes_without_failures(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    stable, canary = await backends("stable-0"), await backends("canary-0")
    pools = {"stable": (["llama-v1"], [(stable, 1)]), "canary": (["llama-v2"], [(canary, 1)])}

    def split(canary_weight: int) -> list[dict[str, object]]:
        targets = [
            {"model": "llama-v1", "weight": 100 - canary_weight},
            {"model": "llama-v2", "weight": canary_weight},
        ]
        return [{"model": "llama", "targets": targets}]

    config_file.write(pools, model_rewrites=split(20))
    gateway = await gateway_factory()

    tally = await served_by(http, gateway.url, "llama", 1000)
    assert set(tally) == {"stable-0", "canary-0"}, tally
    assert abs(tally["canary-0"] / 1000 - 0.20) <= 0.05, tally
    # Each upstream is told the target it was picked for; the targets keep their own routes.
    assert canary.last_headers[names.ROUTED_MODEL_HEADER] == "llama-v2"
    assert stable.last_headers[names.ROUTED_MODEL_HEADER] == "llama-v1"
    assert (await chat(http, gateway.url, "llama-v2"))[:2] == (200, "canary-0")

    # Moving the split under load fails nothing, and the new weights hold at once.
    load = asyncio.create_task(served_by(http, gateway.url, "llama", 300))
    config_file.write(pools, model_rewrites=split(100))

    async def all_canary() -> bool:
        # Twenty in a row: under the old split, one request in five lands there anyway.
        return await served_by(http, gateway.url, "llama", 20) == {"canary-0": 20}

    await eventually(all_canary, what="the split to move to the canary")
    during = await load
    assert set(during) <= {"stable-0", "canary-0"}, during
    assert await served_by(http, gateway.url, "llama", 50) == {"canary-0": 50}


async def test_split_by_header_and_to_an_adapter(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    base = await backends("base-0")
    config_file.write(
        {"base": (["llama-v1"], [(base, 1)])},
        model_rewrites=[
            {"model": "alias", "targets": [{"model": "llama-v1", "weight": 1}]},
            {"model": "sql", "targets": [{"model": "sql-lora-v2", "weight": 1}]},
        ],
        adapters={"base": ["sql-lora-v2"]},
    )
    gateway = await gateway_factory()
    async with http.post(
        f"{gateway.url}/v1/chat/completions",
        json={"messages": []},
        headers={names.ROUTED_MODEL_HEADER: "alias"},
    ) as response:
        assert (response.status, response.headers["x-backend-id"]) == (200, "base-0")
    assert base.last_headers[names.ROUTED_MODEL_HEADER] == "llama-v1"
    # A target that is an adapter goes through the adapter's subset (here: no holder yet,
    # so the fallback, the whole pool).
    assert (await chat(http, gateway.url, "sql"))[:2] == (200, "base-0")
    assert base.last_headers[names.ROUTED_MODEL_HEADER] == "sql-lora-v2"
