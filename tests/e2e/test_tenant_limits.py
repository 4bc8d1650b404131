"""Tenants' request rate limits through a real Envoy (_tenant_limits.py): a tenant over its
rate gets 429 with Retry-After and a body naming the limit, while the others are served."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.e2e.conftest import eventually
from tests.e2e.test_access_log import _lines
from xds_server.envoy import _tenant_limits

TENANT_HEADER = "x-tenant-id"
_STATS = rf"^{_tenant_limits.STAT_PREFIX}\.http_local_rate_limit\."


async def _ask(
    http: aiohttp.ClientSession, url: str, tenant: str | None
) -> tuple[int, dict[str, str], Any]:
    headers = {TENANT_HEADER: tenant} if tenant is not None else {}
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.json(content_type=None)


async def test_a_tenant_over_its_rate_gets_429_naming_the_limit_others_are_served(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, tmp_path
) -> None:
    log = tmp_path / "access.log"
    backend = await backends("llama-0")
    config_file.write(
        {"llama": (["llama"], [(backend, 1)])},
        listener={"access_log": {"path": str(log)}},
        flow_control={
            "tenants": {
                "header": TENANT_HEADER,
                "named": {
                    "small": {"requests_per_s": 0.2},
                    "medium": {"requests_per_s": 5},
                    "big": {"requests_per_s": 1000},
                    "unlimited": {"weight": 2},
                },
            }
        },
    )
    gateway = await gateway_factory()
    # small: a bucket of one request, refilled every 5 s.
    status, _, _ = await _ask(http, gateway.url, "small")
    assert status == 200
    refused = [await _ask(http, gateway.url, "small") for _ in range(3)]
    for status, headers, body in refused:
        assert status == 429, body
        assert headers["Retry-After"] == "5"
        assert body["error"]["code"] == "tenant_rate_limit_exceeded"
        assert body["error"]["type"] == "rate_limit_error"
        assert body["error"]["message"] == (
            "Tenant small is over its request rate limit of 0.2 requests per second;"
            " retry after 5 s."
        )
    # Meanwhile the others are served: a tenant under its limit, one without a limit, one
    # not named, and a request without the header.
    for tenant in ("big", "unlimited", "someone-else", None):
        answers = await asyncio.gather(*(_ask(http, gateway.url, tenant) for _ in range(20)))
        assert [a[0] for a in answers] == [200] * 20, tenant
    # medium: 5 per second, a burst of 5; 40 requests at once get about that many through.
    loop = asyncio.get_running_loop()
    start = loop.time()
    answers = await asyncio.gather(*(_ask(http, gateway.url, "medium") for _ in range(40)))
    elapsed = loop.time() - start
    served = sum(1 for a in answers if a[0] == 200)
    assert {a[0] for a in answers} == {200, 429}
    assert 5 <= served <= 5 + 5 * elapsed + 1, (served, elapsed)
    stats = await gateway.envoy.get_stats(_STATS)
    prefix = f"{_tenant_limits.STAT_PREFIX}.http_local_rate_limit"
    assert stats[f"{prefix}.rate_limited"] == 3 + 40 - served
    assert stats[f"{prefix}.enforced"] == stats[f"{prefix}.rate_limited"]

    # The request log tells a tenant's refusal by its flag (set after the reply's mappers).
    def refusals() -> list[dict[str, Any]]:
        return [line for line in _lines(log) if line["response_code"] == 429]

    await eventually(
        lambda: len(refusals()) == 3 + 40 - served, within_s=30, what="every refusal logged"
    )
    assert {line["response_flags"] for line in refusals()} == {"RL"}
    assert {line["response_code_details"] for line in refusals()} == {"local_rate_limited"}
