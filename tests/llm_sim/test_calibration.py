"""Calibration: a real HTTP saturation probe of one H100-profile pod sustains what
`nominal_capacity` predicts, within 10%.

This is the check that the whole chain (engine, absolute-deadline step loop, SSE delivery,
aiohttp) does not lose capacity to the event loop, so benchmark results reflect the
simulated hardware rather than this machine's load. The profile runs at 4x speed
(`time_scale` 0.25) so that a 500/150-token chat request lives ~2.6 s and the probe covers
its warm-up plus more than a request lifetime in ~7 s; `stream_interval` 16 keeps the HTTP
writes to ~200 per second.
"""

from __future__ import annotations

import pytest

from llm_sim.pod import SimulatedPod
from llm_sim.probe import saturation_probe
from llm_sim.profiles import H100, nominal_capacity

PROMPT, OUTPUT = 500, 150


async def test_one_pod_sustains_its_nominal_capacity() -> None:
    profile = H100.scaled(0.25)
    nominal = nominal_capacity(profile, prompt_tokens=PROMPT, output_tokens=OUTPUT)
    lifetime = nominal.concurrency / nominal.requests_per_s
    clients = profile.max_num_seqs + 16  # always a queue: the pod is saturated
    async with SimulatedPod("probe", profile=profile, stream_interval=16) as pod:
        result = await saturation_probe(
            pod.url + "/v1/chat/completions",
            model=pod.model,
            prompt_tokens=PROMPT,
            output_tokens=OUTPUT,
            concurrency=clients,
            # The first max_num_seqs clients start evenly over one lifetime, so requests'
            # phases are spread as in steady state; the rest queue behind them.
            ramp_s=lifetime * clients / profile.max_num_seqs,
            warmup_s=1.3 * lifetime,
            window_s=1.4 * lifetime,
        )
        snapshot = pod.state_snapshot()
    assert result.errors == 0
    assert snapshot.engine.preemptions == 0
    assert result.output_tokens_per_s == pytest.approx(nominal.output_tokens_per_s, rel=0.10)
    assert result.requests_per_s == pytest.approx(nominal.requests_per_s, rel=0.10)
