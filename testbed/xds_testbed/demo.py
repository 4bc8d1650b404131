"""The local demo: this server, a real Envoy and a simulated mixed GPU fleet, on loopback.

What a newcomer sees: two fast (H100-like) and two slow (A10G-like) simulated vLLM pods
behind one Envoy that this server configures. The same seeded traffic is sent twice, first
with Envoy round robin (what a Kubernetes Service does), then with this project's policy,
while a live table shows each pod's queue, KV-cache use, weight and the requests it got.
At the end a short comparison, then the gateway keeps serving for you to try until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.loadgen import (
    LogNormal,
    RequestClass,
    Summary,
    TraceSpec,
    generate_trace,
    run_replay_in_subprocess,
    summarize,
)
from llm_sim.profiles import A10G, H100, nominal_capacity
from xds_server.config import RoutingConfig
from xds_server.xds.resources import ResourceType
from xds_testbed.gateway import LocalGateway, run_local_gateway

__all__ = ["ERRORS_LEGEND", "run_demo"]

MODEL = "llama-3.1-8b"
PODS = (
    PodSpec(name="h100-0", profile=H100),
    PodSpec(name="h100-1", profile=H100),
    PodSpec(name="a10g-0", profile=A10G),
    PodSpec(name="a10g-1", profile=A10G),
)
# Chat-like requests, shorter than the benchmark's so each phase drains quickly.
PROMPT_WORDS, OUTPUT_TOKENS = 300, 80
LOAD = 0.65  # of the fleet's nominal capacity
ERRORS_LEGEND = (
    "errors: requests of the trace that got no complete 200: an HTTP error or refusal (a"
    " 503, a 429), or no full response (connection refused or reset, a stream cut short, a"
    " timeout, or not sent: 2,000 already open)"
)


@dataclass(frozen=True)
class _Phase:
    label: str
    title: str
    balancing: str


PHASES = (
    _Phase("round robin", "Envoy round robin (a Kubernetes Service)", "round_robin"),
    _Phase("this project", "this project (GPU-aware weights over xDS)", "least_request"),
)


def _document(listener_port: int, fleet: Fleet | None, balancing: str) -> dict[str, Any]:
    """The demo's routing document: its pool over `fleet`'s pods (none when `fleet` is
    None: between phases, the pods retired before they stop)."""
    endpoints = [] if fleet is None else fleet.endpoints()
    return {
        "listener": {"address": "127.0.0.1", "port": listener_port},
        "updates": {"debounce_s": 0.05},
        "pools": [
            {
                "name": "llama",
                "models": [MODEL],
                "balancing": balancing,
                "endpoints": [{"address": host, "port": port} for _, host, port in endpoints],
            }
        ],
    }


def _config(listener_port: int, fleet: Fleet | None, balancing: str) -> RoutingConfig:
    return RoutingConfig.model_validate(_document(listener_port, fleet, balancing))


def _trace_spec(duration_s: float) -> TraceSpec:
    capacity = sum(
        nominal_capacity(
            p.profile, prompt_tokens=PROMPT_WORDS, output_tokens=OUTPUT_TOKENS
        ).requests_per_s
        for p in PODS
    )
    shape = RequestClass(
        name="chat",
        prompt_words=LogNormal(mean=PROMPT_WORDS, sigma=0.4, min=16, max=1500),
        output_tokens=LogNormal(mean=OUTPUT_TOKENS, sigma=0.4, min=4, max=400),
    )
    return TraceSpec(
        duration_s=duration_s, rate_per_s=LOAD * capacity, request_classes=(shape,), model=MODEL
    )


def _weights(gateway: LocalGateway) -> dict[int, int]:
    """Endpoint port -> the weight in the snapshot Envoy is being sent."""
    snapshot = gateway.app.controller.snapshot
    if snapshot is None:
        return {}
    weights = {}
    for resource in snapshot.resources[ResourceType.ENDPOINT].values():
        for locality in resource.message.endpoints:
            for endpoint in locality.lb_endpoints:
                port = endpoint.endpoint.address.socket_address.port_value
                weights[port] = endpoint.load_balancing_weight.value or 1
    return weights


def _view(
    title: str, fleet: Fleet, gateway: LocalGateway, started: float, planned_s: float
) -> Group:
    table = Table(title=title, title_justify="left", expand=False)
    for column in ("pod", "GPU", "running", "waiting", "KV cache", "weight", "requests"):
        table.add_column(
            column, justify="left" if column in ("pod", "GPU", "KV cache") else "right"
        )
    weights = _weights(gateway)
    for pod in fleet:
        state = pod.state_snapshot()
        engine = state.engine
        routed = sum(engine.finished.values()) + engine.num_running + engine.num_waiting
        bar = ProgressBar(total=1.0, completed=engine.kv_usage, width=16)
        table.add_row(
            pod.name,
            pod.profile.name,
            str(engine.num_running),
            str(engine.num_waiting),
            Group(bar, f"{100 * engine.kv_usage:3.0f}%"),
            str(weights.get(pod.port, "-")),
            str(routed),
        )
    elapsed = time.monotonic() - started
    progress = Table.grid(padding=(0, 1))
    progress.add_row(
        "traffic",
        ProgressBar(total=planned_s, completed=min(elapsed, planned_s), width=40),
        f"{elapsed:4.0f} s",
    )
    return Group(table, progress)


async def _phase(
    phase: _Phase,
    *,
    fleet: Fleet,
    gateway: LocalGateway,
    listener_port: int,
    trace_path: Path,
    duration_s: float,
    console: Console,
) -> tuple[Summary, dict[str, int]]:
    """Run the trace once through Envoy with `phase`'s balancing on `fleet`, fresh."""
    gateway.app.submit_config(_config(listener_port, fleet, phase.balancing))
    snapshot = await gateway.app.controller.settled()
    assert snapshot is not None
    await gateway.app.registry.wait_for_ack("eds", snapshot.versions[ResourceType.ENDPOINT])
    started = time.monotonic()
    replaying = asyncio.create_task(
        run_replay_in_subprocess(
            trace_path, url=gateway.url, timeout_s=duration_s + 10, max_in_flight=2000
        )
    )
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        while not replaying.done():
            live.update(_view(phase.title, fleet, gateway, started, duration_s))
            await asyncio.wait({replaying}, timeout=0.25)
        live.update(_view(phase.title, fleet, gateway, started, duration_s))
    result = replaying.result()
    routed = {pod.name: sum(pod.state_snapshot().engine.finished.values()) for pod in fleet}
    # Retire the pods before they stop, as a drained deployment would.
    gateway.app.submit_config(_config(listener_port, None, phase.balancing))
    return summarize(result.results, duration_s=duration_s), routed


def _comparison(summaries: Sequence[tuple[_Phase, Summary, dict[str, int]]]) -> Table:
    table = Table(
        title="Same traffic, two policies",
        title_justify="left",
        caption=ERRORS_LEGEND,
        caption_justify="left",
    )
    for column in ("policy", "TTFT p50", "TTFT p99", "output tok/s", "to slow pods", "errors"):
        table.add_column(column, justify="left" if column == "policy" else "right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{1000 * value:,.0f} ms"

    for phase, summary, routed in summaries:
        slow = sum(v for k, v in routed.items() if k.startswith("a10g"))
        errors = sum(v for k, v in summary.status_counts.items() if k != "200")
        table.add_row(
            phase.label,
            ms(summary.ttft_p50_s),
            ms(summary.ttft_p99_s),
            f"{summary.output_tokens_per_s:,.0f}",
            f"{100 * slow / max(1, sum(routed.values())):.0f}%",
            str(errors),
        )
    return table


async def _start_gateway(
    stack: contextlib.AsyncExitStack,
    config_path: Path,
    document: dict[str, Any],
    *,
    console: Console,
) -> LocalGateway:
    """Start the server on `document` (written to `config_path`) and Envoy, until `stack`
    closes; the demo then submits its configs in process."""
    await asyncio.to_thread(config_path.write_text, yaml.safe_dump(document))
    with console.status("Starting the xDS server and Envoy..."):
        gateway = await stack.enter_async_context(
            run_local_gateway(config_path, config_poll_s=3600)
        )
    console.print(
        f"Envoy listens on [bold]{gateway.url}[/]; this server's admin is on "
        f"http://127.0.0.1:{gateway.app.admin_port} (/metrics), debug views on"
        f" http://127.0.0.1:{gateway.app.debug_port} (/debug/nodes)."
    )
    return gateway


def _port(gateway: LocalGateway) -> int:
    """Envoy's listener port (the one asked for, or the one picked for port 0)."""
    return int(gateway.url.rsplit(":", 1)[1])


async def run_demo(
    *, listener_port: int = 8080, phase_s: float = 15.0, duration_s: float | None = None
) -> None:
    """Run both phases, print the comparison, then serve until Ctrl-C (or `duration_s`)."""
    console = Console()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="xds-demo-")))
        trace_path = workdir / "trace.jsonl"
        generate_trace(_trace_spec(phase_s), seed=1).save(trace_path)
        gateway: LocalGateway | None = None
        summaries = []
        for phase in PHASES:
            async with Fleet(PODS, model=MODEL, stream_interval=4, seed=7) as fleet:
                if gateway is None:
                    # Started on the first phase's pods: the server rightly warns about a
                    # config whose pool has none.
                    first = _document(listener_port, fleet, phase.balancing)
                    gateway = await _start_gateway(
                        stack, workdir / "config.yaml", first, console=console
                    )
                summary, routed = await _phase(
                    phase,
                    fleet=fleet,
                    gateway=gateway,
                    listener_port=_port(gateway),
                    trace_path=trace_path,
                    duration_s=phase_s,
                    console=console,
                )
            summaries.append((phase, summary, routed))
            if stop.is_set():
                return
        assert gateway is not None
        port = _port(gateway)
        console.print(_comparison(summaries))
        fleet = await stack.enter_async_context(Fleet(PODS, model=MODEL, stream_interval=1, seed=7))
        gateway.app.submit_config(_config(port, fleet, "least_request"))
        await gateway.app.controller.settled()
        example = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        )
        console.print(
            "The gateway keeps serving the simulated fleet. Try:\n"
            f"  curl -N {gateway.url}/v1/chat/completions -H 'content-type: application/json' "
            f"-d '{example}'\nPress Ctrl-C to stop.",
            soft_wrap=True,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), duration_s)
        gateway.app.submit_config(_config(port, None, "least_request"))
