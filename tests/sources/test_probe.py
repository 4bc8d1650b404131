"""The probe the server sends a suspected or judged pod (xds_server/sources/probe.py),
against real simulated pods."""

from __future__ import annotations

import asyncio

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.profiles import H100
from xds_server.sources.probe import probe_completion


async def test_a_probe_is_served_by_a_pod_that_serves_and_not_by_one_that_stalls() -> None:
    async with Fleet([PodSpec(name="pod", profile=H100)], model="m") as fleet:
        pod = fleet["pod"]
        assert await probe_completion(pod.host, pod.port, "m", timeout_s=10) is None
        pod.wedge(after_chunks=1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        stalled = await probe_completion(
            pod.host, pod.port, "m", timeout_s=0.5, first_chunk_s=10
        )
        # The first chunk came (it may take up to 10 s), then nothing for 0.5 s.
        assert stalled is not None and stalled.timed_out and stalled.started
        assert "of its first chunk" in str(stalled)
        assert loop.time() - started < 5
        pod.unwedge()
        pod.reset_requests(True)
        refused = await probe_completion(pod.host, pod.port, "m", timeout_s=5)
        assert refused is not None and not refused.timed_out
        pod.reset_requests(False)
        pod.freeze()
        try:
            frozen = await probe_completion(pod.host, pod.port, "m", timeout_s=0.5)
        finally:
            pod.thaw()
        assert frozen is not None and frozen.timed_out and not frozen.started
        assert "no answer began" in str(frozen)
        wrong = await probe_completion(pod.host, pod.port, "no-such-model", timeout_s=5)
        assert wrong is not None and not wrong.timed_out and "HTTP 4" in str(wrong)
