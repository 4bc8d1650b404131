"""A spilling pod's keys, through a real Envoy 1.40: the session cluster's entry of the pod
points at the pool's spill listener, which balances its keys' requests over the pool's
cluster (a LoRA adapter's over its holders), with flow control's band clusters on the way
in. Envoy runs from a static bootstrap of the builders' resources (static_bootstrap.py)
with a decision that marks one pod spilling."""

from __future__ import annotations

import collections
import re
from contextlib import AsyncExitStack

import aiohttp

from tests.envoy.static_bootstrap import static_bootstrap
from xds_server.config import RoutingConfig
from xds_server.envoy import names
from xds_server.policy.decision import Decision
from xds_server.policy.state import EndpointState, PoolState
from xds_testbed import BACKEND_ID_HEADER, EnvoyProcess, ExampleBackend


async def test_a_spilling_pods_keys_are_balanced_over_the_pool_and_its_adapters_holders() -> None:
    async with AsyncExitStack() as exits:
        backends = {
            name: await exits.enter_async_context(
                ExampleBackend(backend_id=name, models=("base", "lora-a"))
            )
            for name in ("spilling", "holder", "other")
        }
        config = RoutingConfig.model_validate(
            {
                "listener": {"address": "127.0.0.1", "port": 0},
                "flow_control": {"enabled": True},
                "pools": [
                    {
                        "name": "llm",
                        "models": ["base"],
                        "adapters": ["lora-a"],
                        "session_affinity": True,
                        "endpoints": [
                            {"address": "127.0.0.1", "port": b.port} for b in backends.values()
                        ],
                    }
                ],
            }
        )

        def endpoint(name: str, **state: object) -> EndpointState:
            port = backends[name].port
            return EndpointState(
                address="127.0.0.1", port=port, name=name, weight=100, ring_weight=100, **state
            )

        decision = Decision(
            pools={
                "llm": PoolState(
                    name="llm",
                    endpoints=(
                        endpoint("spilling", spilling=True, adapters=("lora-a",)),
                        endpoint("holder", adapters=("lora-a",)),
                        endpoint("other"),
                    ),
                )
            }
        )
        envoy = await exits.enter_async_context(EnvoyProcess(static_bootstrap(config, decision)))
        await envoy.wait_live()
        url = f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}"
        http = await exits.enter_async_context(aiohttp.ClientSession())

        async def served(model: str, key: str) -> str:
            body = {"model": model, "messages": [], "user": key}
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                return response.headers[BACKEND_ID_HEADER]

        where: dict[str, set[str]] = collections.defaultdict(set)
        for key in (f"user-{i}" for i in range(24)):
            for _ in range(4):
                where[key].add(await served("base", key))
        # The spilling pod gets nothing; its keys go round the two others (DEGRADED there),
        # and every other key keeps its pod.
        assert not backends["spilling"].requests
        spilled = [k for k, pods in where.items() if len(pods) > 1]
        assert spilled, where
        assert all(where[k] == {"holder", "other"} for k in spilled)
        kept = {next(iter(pods)) for k, pods in where.items() if k not in spilled}
        assert kept == {"holder", "other"}

        # An adapter's keys hash among its holders; the spilling holder's go to the other
        # holder through the spill route's subset, never to a pod without the adapter.
        before = len(backends["other"].requests)
        for key in (f"user-{i}" for i in range(24)):
            assert await served("lora-a", key) == "holder"
            assert backends["holder"].last_headers[names.ROUTED_MODEL_HEADER] == "lora-a"
        assert len(backends["other"].requests) == before
        stat = f"http.{names.HCM_STAT_PREFIX}_spill_llm.downstream_rq_total"
        forwarded = (await envoy.get_stats(f"^{re.escape(stat)}$"))[stat]
        # Each spilled key's four base requests, and the adapter requests of its keys.
        assert forwarded > 4 * len(spilled)
