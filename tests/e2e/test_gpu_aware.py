"""GPU-aware balancing end to end: pod metrics reach a real Envoy as weights and health."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from bench.reaction import FakeVllmPod
from llm_sim.fleet import Fleet, PodSpec
from llm_sim.pod import BACKEND_ID_HEADER
from llm_sim.profiles import H100
from tests.e2e.conftest import eventually
from tests.e2e.gpu_pool import (
    fleet_config,
    gateway_over,
    hosts,
    pod_samples,
)
from xds_testbed.gateway import run_local_gateway


@pytest.fixture
async def pods() -> AsyncIterator[list[FakeVllmPod]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(FakeVllmPod().serving()) for _ in range(3)]


async def test_weights_follow_queues_and_capacity(pods: list[FakeVllmPod], tmp_path: Path) -> None:
    a, b, c = pods
    c.gpu_blocks = 416  # an A10G-like pod: a twelfth of the KV cache
    async with gateway_over(pods, tmp_path) as gateway:

        async def weights() -> dict[int, int]:
            return {port: weight for port, (weight, _) in (await hosts(gateway)).items()}

        async def settled(predicate) -> bool:  # type: ignore[no-untyped-def]
            return predicate(await weights())

        await eventually(
            lambda: settled(lambda w: len(w) == 3 and w[a.port] == w[b.port] > 10 * w[c.port]),
            what="capacity weights",
        )
        b.waiting = 4
        await eventually(
            lambda: settled(lambda w: w[b.port] < w[a.port] / 10), what="B's weight to drop"
        )
        b.waiting = 0
        await eventually(
            lambda: settled(lambda w: w[b.port] == w[a.port]), what="B's weight to recover"
        )

        # The same story on the server's own /metrics, per pod.
        envoy_weights = await weights()
        samples = await pod_samples(gateway)
        for pod in pods:
            pod_id = f"127.0.0.1:{pod.port}"
            assert samples[("xds_pod_weight", pod_id)] == envoy_weights[pod.port]
            assert samples[("xds_pod_healthy", pod_id)] == 1
            assert samples[("xds_pod_requests_waiting", pod_id)] == 0
            assert samples[("xds_pod_kv_cache_usage_ratio", pod_id)] == 0.2
            assert samples[("xds_pod_metrics_age_seconds", pod_id)] < 1


async def test_stale_pod_leaves_rotation_and_comes_back(
    pods: list[FakeVllmPod], tmp_path: Path
) -> None:
    a, b, _ = pods
    async with gateway_over(pods, tmp_path) as gateway:

        async def health_of(port: int) -> str | None:
            entry = (await hosts(gateway)).get(port)
            return None if entry is None else entry[1]

        await eventually(lambda: _is(health_of(b.port), "HEALTHY"), what="B healthy")
        b.broken = True
        await eventually(
            lambda: _is(health_of(b.port), "UNHEALTHY"), within_s=20, what="B out of rotation"
        )
        assert await health_of(a.port) == "HEALTHY"
        b.broken = False
        await eventually(
            lambda: _is(health_of(b.port), "HEALTHY"), within_s=20, what="B back in rotation"
        )


async def test_a_killed_pod_leaves_rotation_at_once_and_never_fails_open(
    tmp_path: Path,
) -> None:
    # Metrics would be stale only after a minute: only the refused scrape can explain how
    # fast the pod leaves. fail_open would keep stale pods; a dead one it must not keep.
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(FakeVllmPod().serving())
        b = FakeVllmPod()
        b_serving = b.serving()
        await b_serving.__aenter__()
        async with gateway_over([a, b], tmp_path, stale_after_s=60) as gateway:

            async def health_of(port: int) -> str | None:
                entry = (await hosts(gateway)).get(port)
                return None if entry is None else entry[1]

            await eventually(lambda: _all(hosts(gateway), "HEALTHY"), what="both healthy")
            await b_serving.__aexit__(None, None, None)  # killed: its port refuses
            await eventually(
                lambda: _is(health_of(b.port), "UNHEALTHY"), within_s=20, what="B out"
            )
            assert await health_of(a.port) == "HEALTHY"
            samples = await pod_samples(gateway)
            assert samples[("xds_pod_healthy", f"127.0.0.1:{b.port}")] == 0
            # Long before stale_after_s: B's last good metrics are only moments old.
            assert samples[("xds_pod_metrics_age_seconds", f"127.0.0.1:{b.port}")] < 30
            # It comes back, on the same port, as soon as a scrape succeeds.
            await stack.enter_async_context(FakeVllmPod().serving(port=b.port))
            await eventually(
                lambda: _is(health_of(b.port), "HEALTHY"), within_s=20, what="B back"
            )


async def test_all_stale_fails_closed_when_configured(
    pods: list[FakeVllmPod], tmp_path: Path
) -> None:
    async with gateway_over(pods, tmp_path, all_stale="fail_closed") as gateway:
        await eventually(lambda: _all(hosts(gateway), "HEALTHY"), what="all healthy")
        for pod in pods:
            pod.broken = True
        await eventually(
            lambda: _all(hosts(gateway), "UNHEALTHY"), within_s=20, what="all out of rotation"
        )


async def _is(value, expected: str) -> bool:  # type: ignore[no-untyped-def]
    return await value == expected


async def _all(view, expected: str) -> bool:  # type: ignore[no-untyped-def]
    got = await view
    return bool(got) and {h for _, h in got.values()} == {expected}


async def test_bias_zero_spaces_requests_round_robin_on_a_uniform_fleet(tmp_path: Path) -> None:
    """`balancing.active_request_bias: 0`: equal GPU-aware weights give Envoy's plain round
    robin (each new request to the next pod), not least request's random two choices."""
    specs = [PodSpec(name=f"pod-{i}", profile=H100) for i in range(3)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(tmp_path, fleet, {"scrape_interval_s": 0.1, "active_request_bias": 0})
        async with run_local_gateway(path, config_poll_s=3600) as gateway:

            async def equal_weights() -> bool:
                got = await hosts(gateway)
                return len(got) == 3 and len({w for w, _ in got.values()}) == 1

            await eventually(equal_weights, what="three equal weights")
            order = []
            async with aiohttp.ClientSession() as http:
                for _ in range(12):
                    body = {"model": "m", "prompt": "hello there", "max_tokens": 1}
                    async with http.post(f"{gateway.url}/v1/completions", json=body) as response:
                        assert response.status == 200
                        order.append(response.headers[BACKEND_ID_HEADER])
                        await response.read()
    # Sequential requests: round robin cycles through the pods in a fixed order.
    assert sorted(order[:3]) == ["pod-0", "pod-1", "pod-2"]
    assert order == order[:3] * 4


async def test_a_long_prompt_steers_short_requests_away_from_its_pod(tmp_path: Path) -> None:
    """A request over `balancing.long_prompt_bytes` (32 KiB by default) goes to the pool's
    long-prompt cluster. The policy learns its pod from the upstream access log as the
    request starts (the load reports here come every 30 s, too late to tell) and cuts that
    pod's weight, so short requests go to the other pod while its prefill holds the GPU;
    when the log shows its first response bytes, the weight comes back, while it still
    decodes (streamed: a non-streamed response sends its body only at the end, so its pod
    stays cut until then). While cut, the pod is DEGRADED: Envoy gives it no new request
    while the other pod is healthy (the weight alone left it some, seen once in CI)."""
    specs = [PodSpec(name=f"pod-{i}", profile=H100) for i in range(2)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(tmp_path, fleet, {"scrape_interval_s": 0.1})
        async with (
            run_local_gateway(path, config_poll_s=3600, load_report_interval_s=30.0) as gateway,
            aiohttp.ClientSession() as http,
        ):

            async def served_by(prompt: str, max_tokens: int) -> str:
                body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
                async with http.post(f"{gateway.url}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                    return response.headers[BACKEND_ID_HEADER]

            async def weights() -> list[int]:
                return sorted(weight for weight, _ in (await hosts(gateway)).values())

            async def equal() -> bool:
                got = await weights()
                return len(got) == 2 and got[0] == got[1]

            await eventually(equal, what="two equal weights")
            # 12k words: about 2 s of prefill on this profile, then 60 tokens of decode.
            long_prompt = asyncio.create_task(served_by("word " * 12_000, 60))

            async def cut() -> bool:
                low, high = await weights()
                return low * 50 < high

            await eventually(cut, within_s=5, what="the long prompt's pod cut")
            view = await hosts(gateway)
            cut_port = min(view, key=lambda port: view[port][0])
            assert view[cut_port][1] == "DEGRADED", view
            (cut_pod,) = [pod for pod in fleet.pods if pod.port == cut_port]
            during = await pod_samples(gateway)
            # Short requests sent while the long prompt still prefills there, at most 6: on
            # a busy machine the cut may come late in the prefill, and what happens after
            # it is the weight coming back (checked below), not a mistake.
            short = []
            while len(short) < 6 and cut_pod.state_snapshot().engine.num_prefilling > 0:
                short.append(await served_by("hello there", 1))
            assert short, "the cut came only once the long prompt's prefill was over"
            assert not long_prompt.done(), "the long prompt finished too early to tell"
            await eventually(equal, within_s=10, what="the weight back once prefill is over")
            assert not long_prompt.done(), "the weight came back only once it finished"
            long_pod = await long_prompt
            stats = await gateway.envoy.get_stats("upstream_rq_total")
    assert set(short) == {"pod-0", "pod-1"} - {long_pod}, (short, long_pod)
    in_flight = {
        p.name: during[("xds_pod_long_prompts", f"127.0.0.1:{p.port}")]
        for p in fleet.pods
    }
    assert in_flight == {long_pod: 1, next(iter(set(short))): 0}
    assert stats["cluster.gpu/long.upstream_rq_total"] == 1
    assert stats["cluster.gpu.upstream_rq_total"] == len(short)
    # Logged as it started, while it lasted, and as it ended; and only the long prompt.
    entries = gateway.app.telemetry.registry.get_sample_value
    assert entries("xds_als_entries_total", {"type": "UpstreamPoolReady"}) == 1
    assert (entries("xds_als_entries_total", {"type": "UpstreamPeriodic"}) or 0) > 10
    assert entries("xds_als_entries_total", {"type": "UpstreamEnd"}) == 1


async def test_pods_prefilling_long_prompts_get_nothing_new_while_one_pod_is_free(
    tmp_path: Path,
) -> None:
    """Two of three pods prefill a long prompt each: both DEGRADED, and every short request
    goes to the third. The assignment's overprovisioning factor is what makes it every one:
    at Envoy's default (140%) one healthy host of three counts as 47% of the pool, and the
    degraded two would get the other 53%."""
    specs = [PodSpec(name=f"pod-{i}", profile=H100) for i in range(3)]
    async with Fleet(specs, model="m") as fleet:
        path = fleet_config(tmp_path, fleet, {"scrape_interval_s": 0.1})
        async with (
            run_local_gateway(path, config_poll_s=3600, load_report_interval_s=30.0) as gateway,
            aiohttp.ClientSession() as http,
        ):

            async def served_by(prompt: str, max_tokens: int) -> str:
                body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
                async with http.post(f"{gateway.url}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                    return response.headers[BACKEND_ID_HEADER]

            def degraded(count: int) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    view = await hosts(gateway)
                    return sum(h == "DEGRADED" for _, h in view.values()) == count

                return check

            await eventually(degraded(0), what="three pods in rotation")
            # 18k and 12k words: about 3 s and 2 s of prefill on this profile.
            first = asyncio.create_task(served_by("word " * 18_000, 1))
            await eventually(degraded(1), within_s=5, what="the first long prompt's pod degraded")
            second = asyncio.create_task(served_by("more " * 12_000, 1))
            await eventually(degraded(2), within_s=5, what="the second long prompt's pod degraded")
            view = await hosts(gateway)
            (free_port,) = [port for port, (_, health) in view.items() if health == "HEALTHY"]
            spilling = await pod_samples(gateway)
            prefilling = [pod for pod in fleet.pods if pod.port != free_port]
            short = []
            while len(short) < 20 and all(
                pod.state_snapshot().engine.num_prefilling > 0 for pod in prefilling
            ):
                short.append(await served_by("hello there", 1))
            long_pods = {await first, await second}
            await eventually(degraded(0), within_s=10, what="the pods back once prefill is over")
    (free_pod,) = [pod.name for pod in fleet.pods if pod.port == free_port]
    assert long_pods == {pod.name for pod in prefilling}, (long_pods, free_pod)
    assert set(short) == {free_pod}, short
    assert len(short) >= 3, "the long prompts' prefills ended too early to tell"
    assert {
        pod.name: spilling[("xds_pod_spilling", f"127.0.0.1:{pod.port}")] for pod in fleet.pods
    } == {pod.name: float(pod.name != free_pod) for pod in fleet.pods}


async def test_with_flow_control_a_long_prompt_is_admitted_by_its_bands_long_cluster(
    tmp_path: Path,
) -> None:
    """With flow control, a long prompt goes to its band's long-prompt cluster
    (`gpu/long/standard`), whose circuit breaker gets its part of the Envoy's band limit
    over RTDS, the band's other lane the rest: a long prompt is no way around admission."""
    async with Fleet([PodSpec(name="pod-0", profile=H100)], model="m") as fleet:
        path = fleet_config(
            tmp_path, fleet, {"scrape_interval_s": 0.1}, flow_control={"enabled": True}
        )
        key = "circuit_breakers.gpu/long/standard.default.max_requests"
        async with (
            run_local_gateway(path, config_poll_s=3600) as gateway,
            aiohttp.ClientSession() as http,
        ):

            async def limits() -> dict[str, str]:
                entries = json.loads(await gateway.envoy.admin_get("/runtime"))["entries"]
                return {k: v["final_value"] for k, v in entries.items() if k.endswith("requests")}

            async def lanes_sum_to_the_limit() -> dict[str, str] | None:
                got = await limits()
                pool = "circuit_breakers.gpu/standard.default.max_requests"
                if key not in got or pool not in got:
                    return None
                admission = gateway.app.controller.decision.admissions["gpu"]
                limit = admission.limits_of("envoy-local")["standard"]
                lanes = int(got[key]), int(got[pool])
                return got if min(lanes) >= 1 and sum(lanes) == limit else None

            await eventually(
                lanes_sum_to_the_limit, what="the band's lanes sharing the Envoy's limit"
            )
            body = {"model": "m", "prompt": "word " * 9_000, "max_tokens": 2, "stream": True}
            async with http.post(f"{gateway.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
            stats = await gateway.envoy.get_stats("upstream_rq_total")
    assert stats["cluster.gpu/long/standard.upstream_rq_total"] == 1
    assert stats["cluster.gpu/standard.upstream_rq_total"] == 0
