"""Many pods in one process, and the exact-state oracle router in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import pytest

from llm_sim.engine import Engine, EngineRequest
from llm_sim.fleet import Fleet, FleetState, PodSpec
from llm_sim.metrics_text import Flavour
from llm_sim.openai_api import parse_completion_request
from llm_sim.oracle import OracleRouter, predicted_ttft
from llm_sim.pod import BACKEND_ID_HEADER, DEFAULT_MODEL
from llm_sim.profiles import A10G, H100

FAST_H100 = H100.scaled(0.1)
FAST_A10G = A10G.scaled(0.1)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


async def test_a_fleet_starts_and_stops_every_pod(http: aiohttp.ClientSession) -> None:
    fleet = Fleet(
        [
            PodSpec(name="h100-0", profile=FAST_H100),
            ("a10g-0", FAST_A10G, Flavour.SGLANG, ()),
            PodSpec(name="h100-lora", profile=FAST_H100, flavour=Flavour.TRITON, adapters=("x",)),
        ],
        stream_interval=2,
    )
    async with fleet:
        assert fleet.state is FleetState.OPEN and len(fleet) == 3
        assert [name for name, _, _ in fleet.endpoints()] == ["h100-0", "a10g-0", "h100-lora"]
        for pod, marker in zip(fleet, ("vllm:", "sglang:", "nv_trt_llm_"), strict=True):
            async with http.get(pod.url + "/metrics") as response:
                assert marker in await response.text()
        assert fleet["h100-lora"].models == (DEFAULT_MODEL, "x")
        urls = [pod.url for pod in fleet]
    assert fleet.state is FleetState.CLOSED
    for url in urls:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(url + "/health"):
                pass
    with pytest.raises(RuntimeError, match="starts only once"):
        await fleet.__aenter__()
    with pytest.raises(ValueError, match="unique"):
        Fleet([PodSpec(name="a", profile=H100), PodSpec(name="a", profile=H100)])


def test_predicted_ttft_grows_with_load_and_shrinks_with_speed() -> None:
    idle_h100 = Engine(H100).state()
    idle_a10g = Engine(A10G).state()
    fast = predicted_ttft(idle_h100, H100, prompt_tokens=500, cached_tokens=0, adapter=None)
    slow = predicted_ttft(idle_a10g, A10G, prompt_tokens=500, cached_tokens=0, adapter=None)
    assert fast == pytest.approx(H100.step_base_s + 500 / H100.prefill_tokens_per_s)
    assert slow > 5 * fast
    cached = predicted_ttft(idle_h100, H100, prompt_tokens=500, cached_tokens=480, adapter=None)
    assert cached < fast
    busy = Engine(H100)
    for i in range(H100.max_num_seqs + 5):  # full batch plus a queue
        words = tuple(f"r{i}w{k}" for k in range(500))
        busy.add(EngineRequest(request_id=str(i), prompt=words, max_tokens=100, arrival=0.0))
    busy.step(0.0)
    loaded = predicted_ttft(busy.state(), H100, prompt_tokens=500, cached_tokens=0, adapter=None)
    assert loaded > 10 * fast  # waits for running requests to finish
    lora = predicted_ttft(idle_h100, H100, prompt_tokens=500, cached_tokens=0, adapter="a")
    assert lora == pytest.approx(fast + H100.lora_load_s)


async def hog(http: aiohttp.ClientSession, url: str, i: int) -> None:
    """A long generation that keeps a slot (or a place in the queue) until cancelled."""
    body = {"prompt": f"hog{i} " * 200, "max_tokens": 2000, "stream": True}
    with contextlib.suppress(aiohttp.ClientError):
        async with http.post(url + "/v1/completions", json=body) as response:
            await response.read()


async def test_the_oracle_routes_by_exact_state(http: aiohttp.ClientSession) -> None:
    specs = [PodSpec(name="fast", profile=FAST_H100), PodSpec(name="slow", profile=FAST_A10G)]
    async with Fleet(specs) as fleet, OracleRouter(fleet.pods, seed=1) as oracle:
        body = {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": "w " * 300}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.post(oracle.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            assert response.headers[BACKEND_ID_HEADER] == "fast"
            raw = await response.read()
        events = raw.decode().split("\n\n")
        assert events[-2] == "data: [DONE]"
        assert json.loads(events[-3][len("data: ") :])["usage"]["completion_tokens"] == 3
        # Load the fast pod beyond its batch: the next request goes to the idle slow pod.
        fast = fleet["fast"]
        hogs = [
            asyncio.create_task(hog(http, fast.url, i))
            for i in range(fast.profile.max_num_seqs + 8)
        ]
        for _ in range(500):
            engine = fast.state_snapshot().engine
            if engine.num_running == fast.profile.max_num_seqs and engine.num_waiting == 8:
                break
            await asyncio.sleep(0.01)
        assert fast.state_snapshot().engine.num_running == fast.profile.max_num_seqs
        body["max_tokens"] = 1
        async with http.post(oracle.url + "/v1/chat/completions", json=body) as response:
            assert response.headers[BACKEND_ID_HEADER] == "slow"
            await response.read()
        assert oracle.decisions == {"fast": 1, "slow": 1}
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        async with http.post(
            oracle.url + "/v1/chat/completions", json=body | {"model": "nope"}
        ) as response:
            assert response.status == 404
        async with http.post(oracle.url + "/v1/completions", data=b"[") as response:
            assert response.status == 400


async def test_ties_are_broken_with_the_seeded_rng() -> None:
    specs = [PodSpec(name=f"p{i}", profile=FAST_H100) for i in range(3)]
    request = parse_completion_request(b'{"prompt": "hello world"}', chat=False)
    picks = []
    for _ in range(2):
        async with Fleet(specs) as fleet, OracleRouter(fleet.pods, seed=42) as oracle:
            picks.append([oracle.choose(request).name for _ in range(60)])
    assert picks[0] == picks[1]  # same seed, same choices
    counts = Counter(picks[0])
    assert set(counts) == {"p0", "p1", "p2"} and min(counts.values()) >= 10


async def test_the_oracle_only_considers_pods_serving_the_model() -> None:
    specs = [
        PodSpec(name="base-only", profile=FAST_H100),
        PodSpec(name="with-lora", profile=dataclasses.replace(FAST_H100), adapters=("sql",)),
    ]
    async with Fleet(specs) as fleet, OracleRouter(fleet.pods) as oracle:
        request = parse_completion_request(b'{"model": "sql", "prompt": "x"}', chat=False)
        assert {oracle.choose(request).name for _ in range(10)} == {"with-lora"}
        with pytest.raises(LookupError):
            oracle.choose(parse_completion_request(b'{"model": "m", "prompt": "x"}', chat=False))
