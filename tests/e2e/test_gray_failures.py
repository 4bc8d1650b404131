"""Pods that look healthy but do not serve, through a real Envoy and simulated pods whose
`/metrics` keep answering: a pod wedged after its first chunk and a pod that resets every
request are judged from the Envoy's load reports (xds_server/verdicts.py), taken out of
rotation, and taken back once a probe is served; an Envoy's report that claims more in
flight than the pods hold is not believed (policy/admission.plausible_load)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.pod import BACKEND_ID_HEADER
from llm_sim.profiles import H100
from tests.e2e.conftest import eventually
from tests.e2e.gpu_pool import fleet_config, hosts
from xds_server.envoy import names
from xds_testbed.gateway import LocalGateway, run_local_gateway

CLIENTS = 32


@dataclass
class Load:
    """CLIENTS clients sending streamed completions back to back; per request the pod
    that served it, when it was sent, and how it ended."""

    url: str
    timeout_s: float = 20.0
    sent: list[tuple[float, str | None, str]] = field(default_factory=list)

    async def one(self, http: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 24, "stream": True}
        pod = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with http.post(f"{self.url}/v1/completions", json=body) as response:
                    pod = response.headers.get(BACKEND_ID_HEADER)
                    text = await response.text()
            outcome = "ok" if response.status == 200 and "[DONE]" in text else "cut"
            if response.status != 200:
                outcome = f"HTTP {response.status}"
        except TimeoutError:
            outcome = "hung"
        except aiohttp.ClientError:
            outcome = "cut"
        self.sent.append((started, pod, outcome))

    async def client(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.one(http)


@contextlib.asynccontextmanager
async def loaded(gateway: LocalGateway) -> AsyncIterator[Load]:
    load = Load(gateway.url)
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        clients = [asyncio.create_task(load.client(http, stop)) for _ in range(CLIENTS)]
        try:
            yield load
        finally:
            stop.set()
            await asyncio.gather(*clients)


@contextlib.asynccontextmanager
async def four_pods(tmp_path: Path) -> AsyncIterator[tuple[Fleet, LocalGateway]]:
    specs = [PodSpec(name=f"pod-{i}", profile=H100) for i in range(4)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(tmp_path, fleet, {"scrape_interval_s": 0.1})
        async with run_local_gateway(path, config_poll_s=3600) as gateway:
            yield fleet, gateway


def verdict_of(gateway: LocalGateway, port: int) -> str | None:
    state = gateway.app.controller.decision.pools.get("gpu")
    if state is None:
        return None
    return next((e.verdict for e in state.endpoints if e.port == port), None)


async def judged_out(
    gateway: LocalGateway, load: Load, port: int, verdict: str
) -> tuple[float, float]:
    """Wait until the pod at `port` is judged `verdict`, then held UNHEALTHY by Envoy, then
    for 200 requests sent after that; returns the loop times of the verdict and of Envoy's."""
    loop = asyncio.get_running_loop()
    await eventually(
        lambda: verdict_of(gateway, port) == verdict,
        within_s=60,
        what=f"the pod judged {verdict}",
    )
    judged_at = loop.time()

    async def out_at_envoy() -> bool:
        return (await hosts(gateway))[port][1] == "UNHEALTHY"

    await eventually(out_at_envoy, within_s=30, what="Envoy holding it UNHEALTHY")
    out_at = loop.time()
    await eventually(
        lambda: sum(1 for t, _, _ in load.sent if t > out_at) >= 200,
        within_s=60,
        what="200 requests after",
    )
    return judged_at, out_at


@pytest.mark.slow
async def test_a_wedged_pod_is_taken_out_and_back_once_it_serves(tmp_path: Path) -> None:
    async with four_pods(tmp_path) as (fleet, gateway), loaded(gateway) as load:
        loop = asyncio.get_running_loop()
        wedged = fleet["pod-0"]
        # The pool's pace is learnt from a few seconds of traffic.
        await eventually(lambda: len(load.sent) >= 200, within_s=60, what="200 requests")
        wedged.wedge(after_chunks=1)
        wedged_at = loop.time()
        judged_at, out_at = await judged_out(gateway, load, wedged.port, "stalled")
        judged_s = judged_at - wedged_at
        # Requests sent once Envoy holds it out never reach it, and all finish.
        after = [(pod, outcome) for t, pod, outcome in load.sent if t > out_at]
        assert all(pod != "pod-0" for pod, _ in after)
        assert {outcome for _, outcome in after} == {"ok"}
        # A probe is served once it serves again: back in rotation.
        wedged.unwedge()
        await eventually(
            lambda: verdict_of(gateway, wedged.port) is None,
            within_s=60,
            what="the pod back after a probe",
        )
        back_at = loop.time()
        await eventually(
            lambda: any(t > back_at + 1 and pod == "pod-0" for t, pod, _ in load.sent),
            within_s=60,
            what="traffic to the pod again",
        )
    samples = gateway.app.telemetry.pod_verdicts.labels("stalled")._value.get()
    assert samples >= 1
    # Within the 2 s on a quiet machine; CI shares its cores (bench g2 measures it).
    assert judged_s < 15, judged_s
    print(f"judged stalled {judged_s:.2f} s after the wedge")


@pytest.mark.slow
async def test_a_resetting_pod_costs_no_request_and_is_taken_out(tmp_path: Path) -> None:
    async with four_pods(tmp_path) as (fleet, gateway), loaded(gateway) as load:
        loop = asyncio.get_running_loop()
        resetting = fleet["pod-1"]
        await eventually(lambda: len(load.sent) >= 100, within_s=60, what="100 requests")
        resetting.reset_requests(True)
        reset_at = loop.time()
        await eventually(
            lambda: verdict_of(gateway, resetting.port) == "failing",
            within_s=30,
            what="the resetting pod judged failing",
        )
        judged_at = loop.time()
        await eventually(
            lambda: sum(1 for t, _, _ in load.sent if t > judged_at) >= 300,
            within_s=60,
            what="300 requests after",
        )
        resetting.reset_requests(False)
        healed_at = loop.time()
        await eventually(
            lambda: verdict_of(gateway, resetting.port) is None,
            within_s=60,
            what="the pod back after a probe",
        )
    during = [(pod, outcome) for t, pod, outcome in load.sent if reset_at < t < healed_at]
    # Every request the pod reset was retried on another pod.
    outcomes = [outcome for _, outcome in during]
    assert set(outcomes) == {"ok"}, {o: outcomes.count(o) for o in set(outcomes)}
    assert all(pod != "pod-1" for pod, _ in during)
    print(f"judged failing {judged_at - reset_at:.2f} s after the resets began")


async def test_one_envoys_inflated_load_report_leaves_the_other_envoys_limits(
    tmp_path: Path,
) -> None:
    specs = [PodSpec(name=f"pod-{i}", profile=H100) for i in range(2)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(
            tmp_path, fleet, {"scrape_interval_s": 0.1}, flow_control={"enabled": True}
        )
        async with (
            run_local_gateway(path, config_poll_s=3600) as gateway,
            grpc.aio.insecure_channel(f"127.0.0.1:{gateway.app.xds_port}") as channel,
        ):
            call = lrs_pb2_grpc.LoadReportingServiceStub(channel).StreamLoadStats()
            await call.write(lrs_pb2.LoadStatsRequest(node=base_pb2.Node(id="forger")))
            await call.read()

            async def report(critical: int) -> None:
                stats = load_report_pb2.ClusterStats(
                    cluster_name=names.band_cluster_name("gpu", "critical"),
                    upstream_locality_stats=[
                        load_report_pb2.UpstreamLocalityStats(
                            total_requests_in_progress=critical, total_issued_requests=critical
                        )
                    ],
                )
                stats.load_report_interval.FromNanoseconds(250_000_000)
                await call.write(lrs_pb2.LoadStatsRequest(cluster_stats=[stats]))

            def limits() -> tuple[int, int] | None:
                admission = gateway.app.controller.decision.admissions.get("gpu")
                if admission is None or set(admission.by_envoy) != {"envoy-local", "forger"}:
                    return None
                return admission.budget["standard"], admission.limits_of("envoy-local")[
                    "standard"
                ]

            await report(0)
            honest = await eventually(limits, what="both Envoys in the admission")
            counter = gateway.app.telemetry.lrs_implausible_reports
            for _ in range(8):
                await report(1000)
                await asyncio.sleep(0.3)
            await eventually(lambda: counter._value.get() >= 1, what="the report not believed")
            assert limits() == honest
            admission = gateway.app.controller.decision.admissions["gpu"]
            assert admission.clipped == {"forger": 1000}
            assert admission.in_flight["critical"] == 0
            call.cancel()


async def _streamed(http: aiohttp.ClientSession, url: str) -> tuple[int, str | None, str, float]:
    """A streamed completion: status, the pod that served it, the body, and seconds taken."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}
    try:
        async with http.post(f"{url}/v1/completions", json=body) as response:
            text = await response.text()
            served_by = response.headers.get(BACKEND_ID_HEADER)
            return response.status, served_by, text, loop.time() - started
    except aiohttp.ClientPayloadError:
        return 200, None, "cut", loop.time() - started


async def test_a_frozen_pods_streams_are_tried_elsewhere_after_the_first_byte_bound(
    tmp_path: Path,
) -> None:
    specs = [PodSpec(name=f"pod-{i}", profile=H100) for i in range(2)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(
            tmp_path,
            fleet,
            {"scrape_interval_s": 0.1, "stale_after_s": 60},
            first_byte_s=1.0,
        )
        async with (
            run_local_gateway(path, config_poll_s=3600) as gateway,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
        ):
            fleet["pod-0"].freeze()
            try:
                answers = await asyncio.gather(*(_streamed(http, gateway.url) for _ in range(8)))
            finally:
                fleet["pod-0"].thaw()
            stats = await gateway.envoy.get_stats(r"cluster\.gpu\.upstream_rq_per_try_timeout$")
    assert [(status, pod) for status, pod, _, _ in answers] == [(200, "pod-1")] * 8
    assert all("[DONE]" in text for _, _, text, _ in answers)
    # Each waited at most the bound (and its retry), not for the freeze to end.
    assert max(seconds for *_, seconds in answers) < 10
    assert stats["cluster.gpu.upstream_rq_per_try_timeout"] >= 1


async def test_a_stream_wedged_mid_way_is_cut_after_the_idle_bound(tmp_path: Path) -> None:
    specs = [PodSpec(name="pod-0", profile=H100)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(tmp_path, fleet, {"scrape_interval_s": 0.1}, stream_idle_s=1.0)
        async with (
            run_local_gateway(path, config_poll_s=3600) as gateway,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
        ):
            fleet["pod-0"].wedge(after_chunks=1)
            status, _, text, seconds = await _streamed(http, gateway.url)
            stats = await gateway.envoy.get_stats(
                r"cluster\.gpu\.upstream_rq_per_try_idle_timeout$"
            )
    # The answer had begun: it ends there (no retry), without [DONE], within the bound.
    assert status == 200 and "[DONE]" not in text
    assert seconds < 10
    assert stats["cluster.gpu.upstream_rq_per_try_idle_timeout"] == 1
