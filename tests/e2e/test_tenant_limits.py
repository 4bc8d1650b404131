"""Tenants' request rate limits through a real Envoy (_tenant_limits.py): a tenant over its
rate gets 429 with Retry-After and a body naming the limit, while the others are served."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import ConfigFile, eventually, peered_replicas
from tests.e2e.test_access_log import _lines
from xds_server.envoy import _tenant_limits
from xds_testbed.backends import ExampleBackend
from xds_testbed.envoy_process import EnvoyProcess

TENANT_HEADER = "x-tenant-id"
_STATS = rf"^{_tenant_limits.STAT_PREFIX}\.http_local_rate_limit\."


async def _ask(
    http: aiohttp.ClientSession, url: str, tenant: str | None, *, model: str = "llama"
) -> tuple[int, dict[str, str], Any]:
    headers = {TENANT_HEADER: tenant} if tenant is not None else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.json(content_type=None)


async def _gateway(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, log: Path, tenants: dict[str, Any]
) -> Any:
    """A gateway (server and Envoy) in front of one backend, logging requests to `log`."""
    backend = await backends("llama-0")
    config_file.write(
        {"llama": (["llama"], [(backend, 1)])},
        listener={"access_log": {"path": str(log)}},
        flow_control={"tenants": tenants},
    )
    return await gateway_factory()


async def test_a_tenant_over_its_rate_gets_429_naming_the_limit_others_are_served(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, tmp_path
) -> None:
    log = tmp_path / "access.log"
    named = {
        "small": {"requests_per_s": 0.2},
        "medium": {"requests_per_s": 5},
        "big": {"requests_per_s": 1000},
        "unlimited": {"weight": 2},
    }
    gateway = await _gateway(
        backends, config_file, gateway_factory, log, {"header": TENANT_HEADER, "named": named}
    )
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
    # ... and by tenant: the line has the tenant header's value.
    by_tenant = {
        t: sum(1 for line in refusals() if line["tenant"] == t) for t in ("small", "medium")
    }
    assert by_tenant == {"small": 3, "medium": 40 - served}
    assert {line["tenant"] for line in _lines(log) if line["response_code"] == 200} >= {
        "small",
        "medium",
        "big",
        "unlimited",
        "someone-else",
        None,
    }
    assert {line["response_code_details"] for line in refusals()} == {"local_rate_limited"}


FLEET_RATE = 10.0


async def _acme_bucket(envoy: EnvoyProcess) -> dict[str, Any] | None:
    """The token bucket of tenant `acme` in the routes `envoy` holds (None: not there)."""
    dump = await envoy.config_dump(resource="dynamic_route_configs")
    for config in dump.get("configs", []):
        for host in config["route_config"].get("virtual_hosts", []):
            limit = host.get("typed_per_filter_config", {}).get(
                _tenant_limits.LOCAL_RATE_LIMIT_FILTER
            )
            for descriptor in (limit or {}).get("descriptors", []):
                if descriptor["entries"] == [{"key": "tenant", "value": "acme"}]:
                    bucket: dict[str, Any] = descriptor["token_bucket"]
                    return bucket
    return None


async def _hammer(
    http: aiohttp.ClientSession, url: str, tenant: str, until: float, tally: dict[str, int]
) -> None:
    """Send `tenant`'s requests back to back until the loop time `until`; count the 200s
    and the refusals by their code."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        status, _, body = await _ask(http, url, tenant, model="m")
        key = "ok" if status == 200 else f"{status} {body['error']['code']}"
        tally[key] = tally.get(key, 0) + 1


@pytest.mark.slow
async def test_two_envoys_on_two_replicas_split_a_tenants_rate_and_keep_it(
    config_file: ConfigFile, http: aiohttp.ClientSession
) -> None:
    """A tenant's `requests_per_s` holds over the fleet: two replicas that peer each give
    their Envoy half of it, and the tenant hammering both Envoys gets the fleet's rate
    within the stated error (docs/flow-control.md, "Tenants")."""
    async with contextlib.AsyncExitStack() as stack:
        backend = await stack.enter_async_context(ExampleBackend(backend_id="pod", models=("m",)))
        config_file.write(
            {"pool": (["m"], [(backend, 1)])},
            flow_control={
                "enabled": True,
                "tenants": {
                    "header": TENANT_HEADER,
                    "named": {
                        "acme": {"requests_per_s": FLEET_RATE},
                        "other": {"requests_per_s": 1000},
                    },
                },
            },
        )
        _, envoys, urls = await peered_replicas(
            stack, config_file.path, (("envoy-1", 0), ("envoy-2", 1))
        )
        for envoy in envoys:
            bucket = await eventually(
                functools.partial(_has_half, envoy),
                within_s=30,
                what="each Envoy to hold half of acme's rate",
            )
            assert bucket == {"max_tokens": 5, "tokens_per_fill": 5, "fill_interval": "1s"}

        loop = asyncio.get_running_loop()
        window_s = 5.0
        start = loop.time()
        acme: list[dict[str, int]] = [{}, {}]
        other: dict[str, int] = {}
        await asyncio.gather(
            *(
                _hammer(http, url, "acme", start + window_s, acme[i])
                for i, url in enumerate(urls)
                for _ in range(3)
            ),
            *(_hammer(http, url, "other", start + window_s, other) for url in urls),
        )
        elapsed = loop.time() - start
        served = sum(t.get("ok", 0) for t in acme)
        refused = "429 tenant_rate_limit_exceeded"
        # Both Envoys refused acme (each holds only its half), and served some of it.
        assert all(t.get(refused, 0) > 0 and t.get("ok", 0) > 0 for t in acme), acme
        # The stated error: at most one bucket and one refill per Envoy over the rate (2 s
        # of the fleet's rate), and at least the refills of the whole seconds.
        assert FLEET_RATE * (elapsed - 1) <= served <= FLEET_RATE * (elapsed + 2), (
            served,
            elapsed,
            acme,
        )
        # The other tenant was never refused for its rate.
        assert other.get("ok", 0) > 0 and refused not in other, other


async def _has_half(envoy: EnvoyProcess) -> dict[str, Any] | None:
    bucket = await _acme_bucket(envoy)
    return bucket if bucket is not None and bucket.get("tokens_per_fill") == 5 else None


async def test_the_body_user_names_the_tenant(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, tmp_path
) -> None:
    log = tmp_path / "access.log"
    tenants = {"body_field": "user", "named": {"small": {"requests_per_s": 0.2}}}
    gateway = await _gateway(backends, config_file, gateway_factory, log, tenants)

    async def ask(user: str | None) -> tuple[int, dict[str, str], Any]:
        body: dict[str, Any] = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
        if user is not None:
            body["user"] = user
        url = f"{gateway.url}/v1/chat/completions"
        async with http.post(url, json=body) as response:
            return response.status, dict(response.headers), await response.json(content_type=None)

    assert (await ask("small"))[0] == 200
    status, headers, body = await ask("small")
    assert status == 429, body
    assert headers["Retry-After"] == "5"
    assert body["error"]["code"] == "tenant_rate_limit_exceeded"
    assert body["error"]["message"].startswith("Tenant small is over its request rate limit")
    # Another user, and a request without one, are served.
    for user in ("someone-else", None, "small-but-not-quite"):
        answers = await asyncio.gather(*(ask(user) for _ in range(10)))
        assert [a[0] for a in answers] == [200] * 10, user
    refused = await eventually(
        lambda: [line for line in _lines(log) if line["response_code"] == 429],
        within_s=30,
        what="the refusal in the request log",
    )
    assert [(line["tenant"], line["response_flags"]) for line in refused] == [("small", "RL")]
