"""SGLang's own endpoints on a simulated pod: what SGLang's router asks a worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from llm_sim.metrics_text import Flavour
from llm_sim.pod import BACKEND_ID_HEADER, DEFAULT_MODEL, SimulatedPod
from llm_sim.profiles import H100

FAST = H100.scaled(0.1)
SGLANG_PATHS = (
    "/get_load",
    "/server_info",
    "/get_server_info",
    "/model_info",
    "/get_model_info",
)


@pytest.fixture
async def pod() -> AsyncIterator[SimulatedPod]:
    async with SimulatedPod("pod-s", profile=FAST, flavour=Flavour.SGLANG) as pod:
        yield pod


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any, str | None]:
    async with http.get(url) as response:
        return response.status, await response.json(), response.headers.get(BACKEND_ID_HEADER)


async def test_an_idle_pods_load_is_one_rank_with_nothing(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    status, load, backend = await get(http, pod.url + "/get_load")
    assert (status, backend) == (200, "pod-s")
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


async def test_load_counts_running_kv_tokens_and_waiting_prompts(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    # More requests than the batch holds: some run, the rest wait with their whole prompt.
    count = FAST.max_num_seqs + 4

    async def one(n: int) -> None:
        # 400 words of their own: no prefix shared between requests.
        prompt = " ".join(f"r{n}w{i}" for i in range(400))
        body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 2000}
        async with http.post(pod.url + "/v1/completions", json=body) as response:
            await response.read()

    tasks = [asyncio.create_task(one(n)) for n in range(count)]
    try:
        for _ in range(200):
            state = pod.state_snapshot().engine
            if state.num_running == FAST.max_num_seqs and state.num_waiting:
                break
            await asyncio.sleep(0.01)
        _, load, _ = await get(http, pod.url + "/get_load")
        (rank,) = load
        assert rank["num_reqs"] == count
        waiting = rank["num_waiting_reqs"]
        assert 0 < waiting <= count - FAST.max_num_seqs
        # Every waiting request's whole prompt, on top of the KV the running batch holds.
        assert rank["num_tokens"] > (waiting + 1) * 400
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_server_and_model_info_name_the_model_under_both_paths(
    pod: SimulatedPod, http: aiohttp.ClientSession
) -> None:
    for path in ("/server_info", "/get_server_info"):
        status, info, _ = await get(http, pod.url + path)
        assert status == 200
        assert (info["model_path"], info["served_model_name"], info["dp_size"]) == (
            DEFAULT_MODEL,
            DEFAULT_MODEL,
            1,
        )
        assert info["max_running_requests"] == FAST.max_num_seqs
        assert info["max_total_tokens"] == FAST.kv_blocks * FAST.block_size
    for path in ("/model_info", "/get_model_info"):
        status, info, _ = await get(http, pod.url + path)
        assert status == 200
        assert info["model_path"] == DEFAULT_MODEL and info["is_generation"] is True
        assert info["architectures"] == ["LlamaForCausalLM"]


async def test_only_an_sglang_flavoured_pod_serves_them(http: aiohttp.ClientSession) -> None:
    # A vLLM pod answers 404 there, as vLLM does: vllm-router's `power_of_two` asks it
    # `/get_load` too (bench/peers.py).
    async with SimulatedPod("pod-v", profile=FAST) as pod:
        for path in SGLANG_PATHS:
            async with http.get(pod.url + path) as response:
                assert response.status == 404, path


async def test_an_http2_preface_gets_a_400_and_no_error_log(
    pod: SimulatedPod, caplog: pytest.LogCaptureFixture
) -> None:
    # SGLang's router probes every worker for gRPC (cleartext HTTP/2) beside `/health`.
    host, port = pod.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9))
        await writer.drain()
        status_line = await reader.readline()
    finally:
        writer.close()
        await writer.wait_closed()
    assert status_line.split()[1] == b"400", status_line
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
