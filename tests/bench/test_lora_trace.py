"""The LoRA sampler (bench/lora_trace.py): what each pod was advertised with and what its
engine ran, sampled while requests run on real simulated pods, and saved as JSON."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import aiohttp

from bench.lora_trace import AdapterSampler
from llm_sim.fleet import Fleet, PodSpec
from llm_sim.profiles import H100


async def test_samples_show_what_each_pod_was_advertised_and_ran(tmp_path: Path) -> None:
    profile = dataclasses.replace(H100, max_loras=1)
    specs = [PodSpec(name=f"pod-{i}", profile=profile, adapters=("a", "b")) for i in range(2)]
    async with Fleet(specs, model="m") as fleet:
        sampler = AdapterSampler(fleet, placement=lambda: {"pod-0": ("a",), "pod-1": ("b",)})
        started = time.time()
        async with sampler.running(), aiohttp.ClientSession() as http:
            # Long enough (64 decode steps) for several samples to see it run.
            body = {"model": "a", "prompt": "hello there", "max_tokens": 64}
            url = f"http://127.0.0.1:{fleet.pods[0].port}/v1/completions"
            async with http.post(url, json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
        path = tmp_path / "adapters.json"
        sampler.save(path, started_at_unix=started)
    document = json.loads(path.read_text())
    assert document["interval_s"] == AdapterSampler.INTERVAL_S
    samples = document["samples"]
    assert len(samples) >= 2
    offsets = [offset for offset, _ in samples]
    assert offsets == sorted(offsets) and offsets[0] >= 0
    for _, pods in samples:
        assert pods["pod-0"]["advertised"] == ["a"] and pods["pod-1"]["advertised"] == ["b"]
        assert pods["pod-1"]["running"] == 0 and pods["pod-1"]["running_adapters"] == []
    assert any(
        pods["pod-0"]["running"] == 1 and pods["pod-0"]["running_adapters"] == ["a"]
        for _, pods in samples
    ), samples
