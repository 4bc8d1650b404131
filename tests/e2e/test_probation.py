"""A pod restarted under load that answers `/health` but not `/metrics` (a real vLLM did so
for ~40 s, issue 36), through a real Envoy and simulated pods: it is on probation within
seconds (a small share, proven by real requests), a verdict still takes it out when it
hangs what it is sent, after a chunk or before any, and its first page ends the
probation (policy/health.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.profiles import H100
from tests.e2e.conftest import eventually
from tests.e2e.gpu_pool import fleet_config, hosts
from tests.e2e.test_gray_failures import Load, judged_out, loaded
from xds_server.policy.state import EndpointState, Health
from xds_server.tuning import MAX_WEIGHT, Tuning
from xds_testbed.gateway import LocalGateway, run_local_gateway

# The longest a restarted pod whose /metrics hangs may wait for traffic: a scrape's backoff
# (2 s), its timeout (1 s), the health check and a push take ~4 s on a quiet machine; CI
# shares its cores. Without probation it would wait for its first page, here for ever.
FIRST_TRAFFIC_S = 20.0


def endpoint(gateway: LocalGateway, port: int) -> EndpointState | None:
    state = gateway.app.controller.decision.pools.get("gpu")
    if state is None:
        return None
    return next((e for e in state.endpoints if e.port == port), None)


def first_reason(gateway: LocalGateway, port: int) -> str | None:
    state = endpoint(gateway, port)
    return state.reasons[0].code if state is not None and state.reasons else None


def served_by(load: Load, pod: str, *, after: float) -> int:
    return sum(1 for t, served, _ in load.sent if t > after and served == pod)


async def state_sample(gateway: LocalGateway, pod_id: str) -> tuple[str, str] | None:
    """xds_pod_state's (state, reason) of the pod, as an operator reads it."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gateway.app.admin_port}/metrics") as response:
            text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # The pod's label: `pod`, or `endpoint` with the labels of issue 37.
            named = sample.labels.get("pod", sample.labels.get("endpoint"))
            if sample.name == "xds_pod_state" and named == pod_id:
                return sample.labels["state"], sample.labels["reason"]
    return None


@pytest.mark.slow
async def test_a_restarted_pod_whose_metrics_hang_serves_on_probation(tmp_path: Path) -> None:
    """On probation it serves a small share; wedged, after a chunk and then at once, it is
    judged stalled and sent nothing. Wedged at once it begins nothing: no engine counter
    can show it, and its probe that never begins is the verdict (verdicts.py, `unpaged`).
    Both wedges in one run: the restart and the share before them take half a minute."""
    specs = [PodSpec(name=f"pod-{i}", profile=H100) for i in range(4)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(tmp_path, fleet, {"scrape_interval_s": 0.1})
        async with (
            run_local_gateway(path, config_poll_s=3600) as gateway,
            loaded(gateway) as load,
        ):
            loop = asyncio.get_running_loop()
            pod = fleet["pod-0"]
            pod_id = f"127.0.0.1:{pod.port}"
            await eventually(lambda: len(load.sent) >= 200, within_s=60, what="200 requests")
            await pod.kill()
            await eventually(
                lambda: first_reason(gateway, pod.port) in {"down", "failing"},
                within_s=30,
                what="the killed pod out of rotation",
            )
            # Out for longer than stale_after_s: its page from before is stale.
            await asyncio.sleep(3)
            await pod.revive(metrics_after_s=3600)
            revived_at = loop.time()
            await eventually(
                lambda: served_by(load, "pod-0", after=revived_at),
                within_s=FIRST_TRAFFIC_S,
                what="a request served by the restarted pod",
            )
            first_traffic_s = loop.time() - revived_at
            assert first_reason(gateway, pod.port) == "probation"
            assert await state_sample(gateway, pod_id) == ("healthy", "probation")
            # Its share is small: a quarter of a peer's weight at Envoy, and of the
            # requests sent over a few seconds, about 0.25 / 3.25.
            weights = await hosts(gateway)
            ladder = Tuning().weight_ladder
            assert weights[pod.port][1] == "HEALTHY"
            assert MAX_WEIGHT * 0.25 / ladder <= weights[pod.port][0] <= MAX_WEIGHT * 0.25 * ladder
            share_from = loop.time()
            await eventually(
                lambda: sum(1 for t, _, _ in load.sent if t > share_from) >= 400,
                within_s=60,
                what="400 requests on probation",
            )
            sent = [(p, o) for t, p, o in load.sent if t > share_from]
            share = sum(1 for p, _ in sent if p == "pod-0") / len(sent)
            assert 0.02 < share < 0.2, share
            assert {o for _, o in sent} == {"ok"}

            # Wedged on probation: judged stalled, out, and sent nothing more; served again (a
            # probe lifts the verdict), on probation again, its page still late.
            judged_s = {}
            for after_chunks in (1, 0):
                pod.wedge(after_chunks=after_chunks)
                wedged_at = loop.time()
                judged_at, out_at = await judged_out(gateway, load, pod.port, "stalled")
                judged_s[after_chunks] = judged_at - wedged_at
                assert served_by(load, "pod-0", after=out_at) == 0
                pod.unwedge()
                await eventually(
                    lambda: first_reason(gateway, pod.port) == "probation",
                    within_s=60,
                    what="back on probation once a probe is served",
                )
            # Then its first page ends the probation and it is weighed as any pod.
            pod.hold_metrics(0)
            await eventually(
                lambda: (state := endpoint(gateway, pod.port)) is not None
                and state.health is Health.HEALTHY
                and not {r.code for r in state.reasons} & {"probation", "probation_ended"},
                within_s=30,
                what="the probation ended by its first page",
            )
    print(
        f"restarted pod served again {first_traffic_s:.2f} s after its restart (its /metrics"
        f" hanging), {share:.3f} of the requests on probation; wedged, judged stalled"
        f" {judged_s[1]:.2f} s later after a chunk, {judged_s[0]:.2f} s wedged at once"
    )
    assert first_traffic_s < FIRST_TRAFFIC_S
