"""GPU-aware balancing through a real Envoy configured over xDS: LoRA affinity, session
affinity with bounded load, and health (panic mode off).

One gateway (this server and a real Envoy) and four example backends serve the whole
module. The policy's Decision (which adapters each pod holds, its weight and health)
is injected the way the controller will push it: a snapshot built by the Envoy builders,
set in the server's cache, and waited on until Envoy ACKs it. The controller does not
rebuild meanwhile: the config file does not change, and its pools are not GPU-aware, so
it scrapes and re-scores nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from xds_server import envoy as builders
from xds_server.config import RoutingConfig
from xds_server.envoy import names
from xds_server.policy.decision import Decision
from xds_server.policy.state import EndpointState, Health, PoolState
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot
from xds_testbed import BACKEND_ID_HEADER, ExampleBackend
from xds_testbed.gateway import LocalGateway, run_local_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

HASH_BALANCE_FACTOR = 150
ADAPTERS = ("lora-a", "lora-b", "lora-c")


@dataclass
class Stack:
    gateway: LocalGateway
    config: RoutingConfig
    backends: Sequence[ExampleBackend]
    hold: asyncio.Event
    http: aiohttp.ClientSession

    async def set_state(
        self,
        health: Sequence[Health] = (Health.HEALTHY,) * 4,
        adapters: Sequence[tuple[str, ...]] = ((),) * 4,
        weights: Sequence[int] = (100,) * 4,
        ring_weights: Sequence[int | None] = (None,) * 4,
        pod_names: Sequence[str | None] = (None,) * 4,
    ) -> None:
        """Give both pools these endpoint states (backend i: health[i], adapters[i],
        weights[i], ring_weights[i], pod_names[i]) and wait until Envoy has ACKed them and
        shows them in /clusters."""
        endpoints = tuple(
            EndpointState(
                address=backend.host,
                port=backend.port,
                name=pod_names[i],
                weight=weights[i],
                ring_weight=ring_weights[i],
                health=health[i],
                adapters=adapters[i],
            )
            for i, backend in enumerate(self.backends)
        )
        state = Decision(
            pools={name: PoolState(name=name, endpoints=endpoints) for name in ("llm", "plain")}
        )
        snapshot = Snapshot.build(
            {
                ResourceType.CLUSTER: builders.build_clusters(self.config),
                ResourceType.ENDPOINT: builders.build_endpoints(self.config, state),
                ResourceType.LISTENER: builders.build_listeners(self.config),
                ResourceType.ROUTE: builders.build_routes(self.config),
            }
        )
        self.gateway.app.cache.set_snapshot(snapshot)
        for resource_type in ResourceType:
            await asyncio.wait_for(
                self.gateway.app.registry.wait_for_ack(
                    resource_type.short, snapshot.versions[resource_type]
                ),
                10,
            )
        expected = {b.port: h.name for b, h in zip(self.backends, health, strict=True)}
        for cluster in ("llm", "llm/session", "plain"):
            assert await self.health_in_envoy(cluster) == expected, cluster

    async def health_in_envoy(self, cluster: str) -> dict[int, str]:
        """Envoy's view, from admin /clusters: endpoint port -> EDS health status."""
        for status in (await self.gateway.envoy.clusters_json())["cluster_statuses"]:
            if status["name"] == cluster:
                return {
                    h["address"]["socket_address"]["port_value"]: h["health_status"][
                        "eds_health_status"
                    ]
                    for h in status.get("host_statuses", [])
                }
        return {}

    async def post(
        self, model: str, *, headers: dict[str, str] | None = None, **body: Any
    ) -> tuple[int, str | None]:
        """One chat completion; returns (status, backend id)."""
        document = {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}
        async with self.http.post(
            f"{self.gateway.url}/v1/chat/completions", json=document, headers=headers or {}
        ) as response:
            await response.read()
            return response.status, response.headers.get(BACKEND_ID_HEADER)

    async def tally(
        self, model: str, count: int, *, headers: dict[str, str] | None = None, **body: Any
    ) -> Counter[str]:
        """`count` requests, 10 at a time: which backend (or `HTTP <status>`) served each."""
        semaphore = asyncio.Semaphore(10)

        async def one() -> str:
            async with semaphore:
                status, backend = await self.post(model, headers=headers, **body)
                return backend if status == 200 and backend else f"HTTP {status}"

        return Counter(await asyncio.gather(*(one() for _ in range(count))))

    async def sequential(
        self, model: str, count: int, *, headers: dict[str, str] | None = None, **body: Any
    ) -> Counter[str]:
        """`count` requests one after the other (nothing in flight: bounded load stays out)."""
        served: Counter[str] = Counter()
        for _ in range(count):
            status, backend = await self.post(model, headers=headers, **body)
            served[backend if status == 200 and backend else f"HTTP {status}"] += 1
        return served

    async def homes(self, keys: Sequence[str]) -> dict[str, str]:
        """The backend each session key goes to (two requests each, both to the same one)."""
        got = {}
        for key in keys:
            served = await self.sequential("base", 2, headers={names.SESSION_HEADER: key})
            assert len(served) == 1, (key, served)
            got[key] = next(iter(served))
        return got

    async def held_streams(
        self, count: int, *, headers: dict[str, str] | None = None, **body: Any
    ) -> tuple[dict[str, int], list[asyncio.Task[int]]]:
        """Open `count` streamed requests for `base` that the backends hold after their first
        chunk, one at a time: each is sent once the previous one has reached its backend.

        One at a time because Envoy counts a request as active only once it is on an
        upstream connection: a burst that must first open connections is all "pending", so
        neither least request nor bounded load sees it (observed on 1.40: 20 simultaneous
        requests for one key on cold connections all went to the key's host).
        Returns the in-flight count per backend and the tasks (status of each response).
        """
        self.hold.clear()
        before = {b.backend_id: b.streams_started - b.streams_finished for b in self.backends}
        tasks = []
        for _ in range(count):
            started = sum(b.streams_started for b in self.backends)
            tasks.append(asyncio.create_task(self._stream(headers, body)))
            async with asyncio.timeout(5):
                # The backends expose counters, not events: poll them briefly.
                while sum(b.streams_started for b in self.backends) == started:  # noqa: ASYNC110
                    await asyncio.sleep(0.002)
        in_flight = {
            b.backend_id: b.streams_started - b.streams_finished - before[b.backend_id]
            for b in self.backends
        }
        return in_flight, tasks

    async def _stream(self, headers: dict[str, str] | None, body: dict[str, Any]) -> int:
        document = {"model": "base", "messages": [], "stream": True, **body}
        async with self.http.post(
            f"{self.gateway.url}/v1/chat/completions", json=document, headers=headers or {}
        ) as response:
            await response.read()
            return response.status

    async def stats(self, pattern: str) -> dict[str, int]:
        return await self.gateway.envoy.get_stats(pattern)


def _document(backends: Sequence[ExampleBackend]) -> dict[str, Any]:
    endpoints = [{"address": b.host, "port": b.port} for b in backends]
    # `gpu_aware: false`: the controller neither scrapes these backends (they have no
    # /metrics) nor re-scores, so the states the tests inject stay in force.
    return {
        "listener": {"address": "127.0.0.1", "port": 0},
        "updates": {"debounce_s": 0.02, "max_delay_s": 0.2},
        "balancing": {"hash_balance_factor": HASH_BALANCE_FACTOR},
        "pools": [
            {
                "name": "llm",
                "models": ["base"],
                "adapters": list(ADAPTERS),
                "session_affinity": True,
                "gpu_aware": False,
                "endpoints": endpoints,
            },
            # The same pods behind a plain weighted-least-request cluster (no subsets).
            {"name": "plain", "models": ["plain"], "gpu_aware": False, "endpoints": endpoints},
        ],
    }


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=["sotw", "delta"])
async def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    hold = asyncio.Event()
    hold.set()
    async with AsyncExitStack() as exits:
        backends = [
            await exits.enter_async_context(ExampleBackend(backend_id=f"b{i}", tokens=3, hold=hold))
            for i in range(4)
        ]
        document = _document(backends)
        path = Path(tmp_path_factory.mktemp("affinity")) / "config.yaml"
        path.write_text(yaml.safe_dump(document))
        gateway = await exits.enter_async_context(
            run_local_gateway(path, delta=request.param == "delta", config_poll_s=0.05)
        )
        http = await exits.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        )
        exits.callback(hold.set)  # never leave a held stream behind
        stack = Stack(gateway, RoutingConfig.model_validate(document), backends, hold, http)
        await stack.set_state()
        yield stack


async def test_lora_requests_go_to_the_adapters_holders(stack: Stack) -> None:
    await stack.set_state(adapters=[("lora-a",), ("lora-a", "lora-b"), ("lora-b",), ()])
    before = await stack.stats(r"^cluster\.llm\.lb_subsets_(selected|fallback)$")

    lora_a = await stack.tally("lora-a", 50)
    assert set(lora_a) == {"b0", "b1"}, lora_a
    lora_b = await stack.tally("lora-b", 50)
    assert set(lora_b) == {"b1", "b2"}, lora_b
    assert stack.backends[1].last_headers[names.ROUTED_MODEL_HEADER] in {"lora-a", "lora-b"}
    # Nobody holds lora-c: the fallback spreads it over the whole pool, like the base model.
    lora_c = await stack.tally("lora-c", 60)
    assert set(lora_c) == {"b0", "b1", "b2", "b3"}, lora_c
    base = await stack.tally("base", 60)
    assert set(base) == {"b0", "b1", "b2", "b3"}, base

    after = await stack.stats(r"^cluster\.llm\.lb_subsets_(selected|fallback)$")
    selected, fallback = "cluster.llm.lb_subsets_selected", "cluster.llm.lb_subsets_fallback"
    assert after[selected] - before[selected] == 100
    assert after[fallback] - before[fallback] == 120


async def test_a_session_key_sticks_to_one_backend(stack: Stack) -> None:
    await stack.set_state()
    before = await stack.stats(r"^cluster\.llm(/session)?\.upstream_rq_total$")
    keys = [f"conversation-{i}" for i in range(10)]
    home: dict[str, str] = {}
    for key in keys:
        served = await stack.sequential("base", 30, headers={names.SESSION_HEADER: key})
        assert len(served) == 1, (key, served)
        home[key] = next(iter(served))
    # Different keys spread over the backends.
    assert len(set(home.values())) >= 2, home

    # The body's `prompt_cache_key`, and else its `user`, are hashed as the header would be.
    for key in keys:
        assert await stack.sequential("base", 10, prompt_cache_key=key) == {home[key]: 10}
        assert await stack.sequential("base", 10, user=key) == {home[key]: 10}

    # Precedence: the client's header, then prompt_cache_key, then user.
    k1, k2 = _two_keys_apart(home)
    assert await stack.sequential(
        "base", 5, headers={names.SESSION_HEADER: k1}, prompt_cache_key=k2
    ) == {home[k1]: 5}
    assert await stack.sequential("base", 5, prompt_cache_key=k2, user=k1) == {home[k2]: 5}
    assert await stack.sequential("base", 5, prompt_cache_key="", user=k1) == {home[k1]: 5}
    # A key that cannot be a header value (a newline) is served, as a keyless request.
    status, _ = await stack.post("base", user="line one\nline two")
    assert status == 200

    after = await stack.stats(r"^cluster\.llm(/session)?\.upstream_rq_total$")
    hashed = 300 + 200 + 15
    assert after["cluster.llm/session.upstream_rq_total"] == (
        before["cluster.llm/session.upstream_rq_total"] + hashed
    )
    assert after["cluster.llm.upstream_rq_total"] == before["cluster.llm.upstream_rq_total"] + 1


async def test_session_keys_follow_the_ring_weights_not_the_load_weights(stack: Stack) -> None:
    keys = [f"conversation-{i}" for i in range(12)]

    await stack.set_state(ring_weights=(100,) * 4)
    home = await stack.homes(keys)
    assert len(set(home.values())) >= 2, home
    # The load weights swing to one backend; the ring keeps its weights: no key moves.
    await stack.set_state(weights=(100_000, 1, 1, 1), ring_weights=(100,) * 4)
    assert await stack.homes(keys) == home
    # Without ring weights the ring takes the load weights, and keys go with them: all but
    # one at most (each pod takes one slot of the 1,009 before weights count: maglev.py).
    await stack.set_state(weights=(100_000, 1, 1, 1))
    assert sum(b == "b0" for b in (await stack.homes(keys)).values()) >= len(keys) - 1


async def test_session_keys_follow_pod_names_not_addresses(stack: Stack) -> None:
    """Maglev hashes each endpoint's hostname (its pod name): when the pods' names move to
    other addresses (a pod back with a new IP), every key follows its pod's name."""
    keys = [f"conversation-{i}" for i in range(12)]

    pods = ("ml/pod-a", "ml/pod-b", "ml/pod-c", "ml/pod-d")
    await stack.set_state(pod_names=pods)
    home = await stack.homes(keys)
    assert len(set(home.values())) >= 2, home
    by_name = {key: pods[int(backend[1:])] for key, backend in home.items()}
    # Backend i now carries the name backend i+1 had: each key moves to its name's backend.
    rotated = pods[1:] + pods[:1]
    await stack.set_state(pod_names=rotated)
    assert {key: rotated[int(b[1:])] for key, b in (await stack.homes(keys)).items()} == by_name
    assert await stack.homes(keys) != home


async def test_a_hot_session_overflows_within_the_bounded_load(stack: Stack) -> None:
    await stack.set_state()
    count = 30
    in_flight, tasks = await stack.held_streams(count, headers={names.SESSION_HEADER: "hot"})
    stack.hold.set()
    assert all(status == 200 for status in await asyncio.gather(*tasks))
    assert sum(in_flight.values()) == count
    # Envoy lets a host take one more request while it has at most
    # ceil(factor x (in flight + 1) x its weight share): with equal weights, no backend
    # ends above ceil(1.5 x mean) + 1, so the hot key spills over to other pods.
    bound = math.ceil(HASH_BALANCE_FACTOR / 100 * count / len(stack.backends)) + 1
    assert max(in_flight.values()) <= bound, in_flight
    assert sum(1 for n in in_flight.values() if n) >= 2, in_flight

    # Without a key: the pool's weighted least-request cluster, over every backend.
    before = await stack.stats(r"^cluster\.llm(/session)?\.upstream_rq_total$")
    in_flight, tasks = await stack.held_streams(20)
    stack.hold.set()
    assert all(status == 200 for status in await asyncio.gather(*tasks))
    assert min(in_flight.values()) >= 1, in_flight
    after = await stack.stats(r"^cluster\.llm(/session)?\.upstream_rq_total$")
    assert {name: after[name] - before[name] for name in after} == {
        "cluster.llm.upstream_rq_total": 20,
        "cluster.llm/session.upstream_rq_total": 0,
    }


async def test_unhealthy_endpoints_get_nothing_even_when_most_are(stack: Stack) -> None:
    unhealthy, healthy = Health.UNHEALTHY, Health.HEALTHY
    await stack.set_state(
        health=[healthy, unhealthy, unhealthy, unhealthy],
        adapters=[(), ("lora-a",), ("lora-a",), ()],
    )
    # Below Envoy's default panic threshold (50% healthy) it would spread over all four;
    # with the threshold at 0 only the healthy one serves, on every kind of cluster.
    assert await stack.tally("base", 40) == {"b0": 40}
    assert await stack.tally("plain", 40) == {"b0": 40}
    assert await stack.sequential("base", 10, user="some-user") == {"b0": 10}
    # lora-a's holders are out of rotation: the request falls back to the healthy pod
    # instead of failing (endpoints.py lists adapters on healthy endpoints only).
    assert await stack.tally("lora-a", 20) == {"b0": 20}

    await stack.set_state(health=[unhealthy] * 4)
    status, _ = await stack.post("base")
    assert status == 503


async def test_a_draining_endpoint_gets_no_new_requests(stack: Stack) -> None:
    # A stream in flight on b1 (the only holder of lora-a), then b1 starts draining.
    await stack.set_state(adapters=[(), ("lora-a",), (), ()])
    in_flight, tasks = await stack.held_streams(1, model="lora-a")
    assert in_flight["b1"] == 1
    healthy, draining = Health.HEALTHY, Health.DRAINING
    await stack.set_state(
        health=[healthy, draining, healthy, draining], adapters=[(), ("lora-a",), (), ()]
    )
    for model in ("base", "plain", "lora-a"):
        served = await stack.tally(model, 40)
        assert set(served) == {"b0", "b2"}, (model, served)
    # The request it already had finishes normally.
    stack.hold.set()
    assert await asyncio.gather(*tasks) == [200]


def _two_keys_apart(home: dict[str, str]) -> tuple[str, str]:
    """Two keys whose sessions live on different backends."""
    first = next(iter(home))
    second = next(key for key, backend in home.items() if backend != home[first])
    return first, second
