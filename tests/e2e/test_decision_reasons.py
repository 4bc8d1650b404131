"""Every decision explained, through a running server: /debug/decision shows each pod's
reasons with their figures, and xds_pod_state / xds_pod_spilling carry the reason codes."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.reaction import FakeVllmPod
from tests.e2e.conftest import eventually
from xds_server.config import RoutingConfig
from xds_server.policy.reasons import CODES
from xds_testbed.gateway import LocalGateway, run_local_gateway


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200, (url, response.status)
        return await response.text()


async def decision(gateway: LocalGateway, pool: str | None = None) -> dict[str, Any]:
    query = "" if pool is None else f"?pool={pool}"
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{gateway.app.debug_port}/debug/decision{query}") as response,
    ):
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body


async def labelled_samples(gateway: LocalGateway, name: str) -> list[dict[str, str]]:
    """The labels of every sample of `name` whose value is 1."""
    text = await _get(f"http://127.0.0.1:{gateway.app.admin_port}/metrics")
    return [
        dict(s.labels)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.value == 1
    ]


async def test_a_queueing_pods_spill_and_a_silent_pods_absence_are_explained(
    tmp_path: Path,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(FakeVllmPod().serving()) for _ in range(3)]
        a, b, c = pods
        config = RoutingConfig.model_validate(
            {
                "listener": {"address": "127.0.0.1", "port": 0},
                "updates": {"debounce_s": 0.02},
                "balancing": {"scrape_interval_s": 0.1, "smoothing": 1.0, "stale_after_s": 0.6},
                "pools": [
                    {
                        "name": "gpu",
                        "models": ["m"],
                        "session_affinity": True,
                        "batch_limit": 48,
                        "endpoints": [{"address": "127.0.0.1", "port": p.port} for p in pods],
                    }
                ],
            }
        )
        path = tmp_path / "config.yaml"
        path.write_text(config.model_dump_json())
        gateway = await stack.enter_async_context(run_local_gateway(path, config_poll_s=3600))
        ids = {pod.port: f"127.0.0.1:{pod.port}" for pod in pods}

        async def states() -> dict[str, dict[str, Any]]:
            return {e["pod"]: e for e in (await decision(gateway)).get("pools", {}).get("gpu", [])}

        async def all_healthy() -> bool:
            got = await states()
            return len(got) == 3 and all(e["state"] == "healthy" for e in got.values())

        await eventually(all_healthy, what="every pod healthy")
        assert set((await decision(gateway))["reason_codes"]) == set(CODES)

        b.waiting = 6

        async def b_spills() -> bool:
            return (await states()).get(ids[b.port], {}).get("state") == "spilling"

        await eventually(b_spills, what="B spilling for its queue")
        explained = (await states())[ids[b.port]]
        codes = [r["code"] for r in explained["reasons"]]
        assert codes[0] == "spill_queue", explained
        assert "queue 6 > slack 1" in explained["reasons"][0]["detail"], explained
        assert "weight_queue" in codes, explained
        assert (await states())[ids[a.port]]["reasons"] == []
        spilling = await labelled_samples(gateway, "xds_pod_spilling")
        assert {(s["endpoint"], s["reason"]) for s in spilling} == {(ids[b.port], "spill_queue")}
        state = await labelled_samples(gateway, "xds_pod_state")
        got = {s["endpoint"]: (s["pool"], s["state"], s["reason"]) for s in state}
        assert got[ids[b.port]] == ("gpu", "spilling", "spill_queue")
        assert got[ids[a.port]] == ("gpu", "healthy", "none")

        c.broken = True

        async def c_out() -> bool:
            return (await states()).get(ids[c.port], {}).get("state") == "unhealthy"

        await eventually(c_out, within_s=20, what="C out of rotation")
        (reason,) = [r for r in (await states())[ids[c.port]]["reasons"]]
        assert reason["code"] == "stale" and reason["detail"].startswith("silent for"), reason
        state = await labelled_samples(gateway, "xds_pod_state")
        got = {s["endpoint"]: (s["pool"], s["state"], s["reason"]) for s in state}
        assert got[ids[c.port]] == ("gpu", "unhealthy", "stale")
        assert {s["reason"] for s in state} <= {*CODES, "none"}
        assert set((await decision(gateway, pool="gpu"))["pools"]) == {"gpu"}
        assert (await decision(gateway, pool="other"))["pools"] == {}
