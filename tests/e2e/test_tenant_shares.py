"""Tenants' fair shares of a band through real Envoys (docs/flow-control.md, "Tenants"):
three weighted tenants (1, 2, 3) hammering one band through two Envoys on two peered server
replicas each get their weighted share of its budget; an idle tenant's share is lent to
the others and taken back when it returns; the 429s say which limit refused them."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import ConfigFile, eventually, peered_replicas
from tests.e2e.test_replicas import _metric, _sampling
from xds_server.envoy import names
from xds_testbed.backends import ExampleBackend
from xds_testbed.server_process import ServerProcess

TENANT_HEADER = "x-tenant-id"
# The pool's Standard budget (critical headroom 0): the shared lane keeps its floor (one
# place per Envoy) and the tenants share the other 24 by weight: 4, 8 and 12.
BUDGET = 26
WEIGHTS = {"a": 1, "b": 2, "c": 3}
SHARES = {"a": 4, "b": 8, "c": 12}
# Clients per tenant and Envoy: more than each Envoy's half of the tenant's share, and a
# over its half of what it borrows while c is idle (22 places 1:2, 7 for a).
CLIENTS = {"a": 5, "b": 8, "c": 9}
REQUEST_S = 1.0  # each admitted request streams for about this long
RETRY_S = 0.1  # a refused client knocks again this soon


class Tenants:
    """Clients that keep each tenant's requests knocking: what each has in flight (from
    its 200 to the end of its stream), and every refusal by its code."""

    def __init__(self, http: aiohttp.ClientSession, urls: list[str]) -> None:
        self.http = http
        self.urls = urls
        self.in_flight = dict.fromkeys(WEIGHTS, 0)
        self.refusals: dict[str, dict[str, int]] = {t: {} for t in WEIGHTS}
        self.replies: dict[str, tuple[dict[str, str], Any]] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {t: [] for t in WEIGHTS}

    def start(self, tenant: str) -> None:
        for url in self.urls:
            for _ in range(CLIENTS[tenant]):
                self._tasks[tenant].append(asyncio.create_task(self._client(tenant, url)))

    async def stop(self, tenant: str) -> None:
        for task in self._tasks[tenant]:
            task.cancel()
        await asyncio.gather(*self._tasks[tenant], return_exceptions=True)
        self._tasks[tenant] = []

    async def _client(self, tenant: str, url: str) -> None:
        body = {"model": "m", "messages": [], "stream": True}
        headers = {TENANT_HEADER: tenant}
        while True:
            async with self.http.post(
                f"{url}/v1/chat/completions", json=body, headers=headers
            ) as response:
                if response.status != 200:
                    answer = await response.json(content_type=None)
                    code = f"{response.status} {answer['error']['code']}"
                    self.refusals[tenant][code] = self.refusals[tenant].get(code, 0) + 1
                    self.replies[code] = (dict(response.headers), answer)
                    await asyncio.sleep(RETRY_S)
                    continue
                self.in_flight[tenant] += 1
                try:
                    await response.read()
                finally:
                    self.in_flight[tenant] -= 1


async def _parts(server: ServerProcess) -> dict[str, int]:
    nodes = await server.get_json("/debug/nodes")
    budgets = nodes["fleet"]["budgets"].get("pool", {})
    parts: dict[str, int] = budgets.get("tenants", {}).get("standard", {}).get("parts", {})
    return parts


async def _since(
    loop: asyncio.AbstractEventLoop, start: float, done: Any, within_s: float
) -> float:
    """Seconds from `start` until `done()` holds (polled every 20 ms)."""
    while not done():
        if loop.time() - start > within_s:
            raise AssertionError(f"not within {within_s} s")
        await asyncio.sleep(0.02)
    return loop.time() - start


@pytest.mark.slow
async def test_weighted_tenants_share_a_band_lend_an_idle_share_and_take_it_back(
    config_file: ConfigFile, http: aiohttp.ClientSession
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        tokens = 10
        backend = await stack.enter_async_context(
            ExampleBackend(
                backend_id="pod", models=("m",), tokens=tokens, token_delay=REQUEST_S / tokens
            )
        )
        named: dict[str, Any] = {t: {"weight": w} for t, w in WEIGHTS.items()}
        named["d"] = {"requests_per_s": 2}  # no weight: the shared lane, 1 per s per Envoy
        config_file.write(
            {"pool": (["m"], [(backend, 1)])},
            flow_control={
                "enabled": True,
                "default_pod_concurrency": BUDGET,
                "critical_headroom": 0,
                "tenants": {"header": TENANT_HEADER, "named": named},
            },
        )
        replicas, _, urls = await peered_replicas(
            stack, config_file.path, (("envoy-1", 0), ("envoy-2", 1))
        )

        async def agreed() -> bool:
            for server in replicas:
                nodes = await server.get_json("/debug/nodes")
                envoys = nodes["fleet"]["envoys"]
                if len(envoys) != 2 or not all(e["reports_load"] for e in envoys):
                    return False
                if sum((await _parts(server)).values()) != BUDGET:
                    return False
            return True

        await eventually(
            agreed, within_s=30, what="both replicas splitting the band over both Envoys"
        )
        loop = asyncio.get_running_loop()
        tenants = Tenants(http, urls)
        for tenant in WEIGHTS:
            tenants.start(tenant)

        # Under contention, each gets its weighted share of what is admitted.
        await asyncio.sleep(2 * REQUEST_S)
        async with _sampling(lambda: dict(tenants.in_flight)) as samples:
            await asyncio.sleep(3 * REQUEST_S)
        means = {t: statistics.fmean(s[t] for s in samples) for t in WEIGHTS}
        total = sum(means.values())
        for tenant, weight in WEIGHTS.items():
            share = means[tenant] / total
            expected = weight / sum(WEIGHTS.values())
            assert abs(share - expected) <= 0.1 * expected, (tenant, means)
        # Never more than the budget plus the floors in flight over the fleet.
        assert max(sum(s.values()) for s in samples) <= BUDGET + 2 * len(urls), samples
        print("contention: mean in flight", {t: round(m, 2) for t, m in means.items()})

        # c goes idle: a and b borrow its places ...
        await tenants.stop("c")
        start = loop.time()
        lent_s = await _since(
            loop,
            start,
            lambda: tenants.in_flight["a"] + tenants.in_flight["b"] >= BUDGET - 4 - 2,
            within_s=10,
        )
        print(f"c's share lent to a and b in {lent_s:.2f} s")
        async with _sampling(lambda: dict(tenants.in_flight)) as samples:
            await asyncio.sleep(REQUEST_S)
        print(
            "c idle: mean in flight",
            {t: round(statistics.fmean(s[t] for s in samples), 2) for t in "ab"},
        )
        # ... and give them back when it returns: c reaches its share (but a place) within
        # a decision interval plus the drain of their extra requests.
        start = loop.time()
        tenants.start("c")
        back_s = await _since(
            loop, start, lambda: tenants.in_flight["c"] >= SHARES["c"] - 1, within_s=10
        )
        print(f"c's share back in {back_s:.2f} s")
        assert back_s <= REQUEST_S + 1.5, back_s
        async with _sampling(lambda: dict(tenants.in_flight)) as samples:
            await asyncio.sleep(REQUEST_S)
        assert max(sum(s.values()) for s in samples) <= BUDGET + 2 * len(urls), samples

        # The servers' metrics: each lane's part, and what each replica's Envoy admitted
        # and refused on it.
        for tenant, share in SHARES.items():
            labels = {"pool": "pool", "band": "standard", "tenant": tenant}
            assert await _metric(replicas[0], "xds_tenant_share", **labels) == share
            for server in replicas:
                assert (await _metric(server, "xds_tenant_admitted_total", **labels) or 0) > 0
                assert (await _metric(server, "xds_tenant_refused_total", **labels) or 0) > 0

        # Each weighted tenant was refused by its own share, never by a rate.
        for tenant in WEIGHTS:
            assert set(tenants.refusals[tenant]) == {"429 tenant_share_exceeded"}, tenants.refusals
        headers, answer = tenants.replies["429 tenant_share_exceeded"]
        assert int(headers["Retry-After"]) >= 1
        assert answer["error"]["type"] == "rate_limit_error"
        assert "share of the standard band of pool pool" in answer["error"]["message"]

        # A tenant over its request rate is told so, while the others keep their shares.
        refused_before = {t: dict(r) for t, r in tenants.refusals.items()}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        statuses = []
        for _ in range(3):
            async with http.post(
                f"{urls[0]}/v1/chat/completions", json=body, headers={TENANT_HEADER: "d"}
            ) as response:
                statuses.append(response.status)
                answer = await response.json(content_type=None)
                if response.status == 429:
                    assert response.headers["Retry-After"] == "1"
                    assert answer["error"]["code"] == "tenant_rate_limit_exceeded"
                    assert answer["error"]["message"].startswith(
                        "Tenant d is over its request rate limit of 2 requests per second"
                    )
        assert statuses[0] == 200 and 429 in statuses[1:], statuses
        for tenant in WEIGHTS:
            assert set(tenants.refusals[tenant]) == set(refused_before[tenant]), tenants.refusals
            assert tenants.in_flight[tenant] > 0
        for tenant in WEIGHTS:
            await tenants.stop(tenant)


async def test_a_body_named_tenant_takes_its_lane_in_each_band_and_its_429_names_its_share(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http
) -> None:
    """With the tenant in the body's `user`: its requests take its own lane of the band
    they are given (routes on `llm:tenant`), another user's take the band's shared lane,
    a split's requests take its lanes of the target pools, and its lane's full circuit
    breaker answers 429 `tenant_share_exceeded` (the mapper matches `llm:tenant`). The
    lane's limit is set here as the policy sets it, as its runtime key, through Envoy's
    admin runtime layer."""
    backend = await backends("llama-0")
    config_file.write(
        {"llama": (["llama"], [(backend, 1)])},
        model_rewrites=[{"model": "canary", "targets": [{"model": "llama", "weight": 1}]}],
        flow_control={
            "enabled": True,
            "tenants": {
                "body_field": "user",
                "named": {"acme": {"weight": 2}, "bob@example.com": {"weight": 1}},
            },
        },
    )
    gateway = await gateway_factory()
    envoy = gateway.envoy

    async def ask(user: str, band: str, model: str = "llama") -> tuple[int, dict[str, str], Any]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "user": user}
        headers = {"x-gateway-inference-band": band}
        async with http.post(
            f"{gateway.url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            return response.status, dict(response.headers), await response.json(content_type=None)

    async def served(cluster: str) -> int:
        stats = await envoy.get_stats(r"^cluster\.llama/.*\.upstream_rq_total$")
        return int(stats.get(f"cluster.{cluster}.upstream_rq_total", 0))

    for band in ("standard", "sheddable"):
        lane = names.tenant_cluster_name("llama", band, "acme")
        before = await served(lane), await served(names.band_cluster_name("llama", band))
        assert (await ask("acme", band))[0] == 200
        assert (await ask("someone-else", band))[0] == 200
        after = await served(lane), await served(names.band_cluster_name("llama", band))
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1), band
    # A split (model_rewrites) sends a weighted tenant to its lanes of the target pools.
    lane = names.tenant_cluster_name("llama", "standard", "acme")
    before_split = await served(lane)
    assert (await ask("acme", "standard", model="canary"))[0] == 200
    assert await served(lane) == before_split + 1
    # A name with `.` and `@` makes a valid lane (its Prometheus cluster tag is cut at the
    # dot: docs/flow-control.md), its runtime key too.
    dotted = names.tenant_cluster_name("llama", "standard", "bob@example.com")
    before_dotted = await served(dotted)
    assert (await ask("bob@example.com", "standard"))[0] == 200
    assert await served(dotted) == before_dotted + 1
    # Critical has no tenant lanes (it is never limited).
    assert (await ask("acme", "critical"))[0] == 200

    key = f"circuit_breakers.{names.tenant_cluster_name('llama', 'standard', 'acme')}"
    async with http.post(
        f"{envoy.admin_url}/runtime_modify", params={f"{key}.default.max_requests": "0"}
    ) as response:
        assert response.status == 200, await response.text()
    async with http.post(
        f"{envoy.admin_url}/runtime_modify",
        params={f"circuit_breakers.{dotted}.default.max_requests": "0"},
    ) as response:
        assert response.status == 200, await response.text()
    assert (await ask("bob@example.com", "standard"))[0] == 429
    status, headers, answer = await ask("acme", "standard")
    assert status == 429, answer
    assert answer["error"]["code"] == "tenant_share_exceeded"
    assert answer["error"]["message"].startswith(
        "Tenant acme has its full share of the standard band of pool llama in flight;"
    )
    assert int(headers["Retry-After"]) >= 1
    # Another user is served from the shared lane meanwhile, and acme in Sheddable.
    assert (await ask("someone-else", "standard"))[0] == 200
    assert (await ask("acme", "sheddable"))[0] == 200
