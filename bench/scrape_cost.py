"""What one pod scrape costs the control plane, and so how often pods can be scraped.

The policy is only as fresh as the last scrape, and every scrape costs CPU on the control
plane: an HTTP request on a kept-alive connection, a 40-60 KB page, the parse, the engine
adapter, the store. This measures that cost end to end, with the project's own `Scraper`:

1. Parse only, per page: the fast parser (`exposition.parse_samples` through the vLLM
   adapter) against prometheus-client's full parser, which reads every line.
2. Whole scrapes: N simulated vLLM pods serve their pages over loopback from a CHILD
   process (so their rendering is not billed here), the `Scraper` fetches them on an
   interval, and the CPU this process spends (`time.process_time()`) is divided by the
   scrapes done.

Both on the simulator's vLLM page (~43 KB, ~450 lines) and on a synthetic 59 KB, 628-line
page (the simulator's, padded with histogram families like a newer vLLM's), the size of a
real one. Target: at most 0.5 ms of CPU per scrape, i.e. 2,000 pod-scrapes per second on one
core (200 pods at 10 Hz, or 1,000 pods at 2 Hz).

    python bench/scrape_cost.py [--pods 200] [--interval 0.1] [--seconds 4] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llm_sim.engine import Engine, EngineRequest
from llm_sim.metrics_text import Flavour, HttpStats, render_metrics, restrict_page
from llm_sim.pod import SimulatedPod
from llm_sim.profiles import H100
from xds_server.metrics.engines import engine_adapter
from xds_server.metrics.exposition import parse_samples
from xds_server.metrics.scraper import Scraper, ScrapeTarget
from xds_server.metrics.store import MetricsStore

__all__ = ["main", "synthetic_page"]

_REPO = Path(__file__).resolve().parents[1]
_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TARGET_CPU_MS = 0.5


# -- pages ---------------------------------------------------------------------------------


def simulator_page() -> str:
    """A busy simulated vLLM pod's page, with the HTTP-server families a served pod has."""
    engine = Engine(H100, seed=1)
    for i in range(40):
        prompt = tuple(f"w{i}-{k}" for k in range(100 + 20 * (i % 9)))
        engine.add(
            EngineRequest(
                request_id=f"r{i}",
                prompt=prompt,
                max_tokens=8 + i % 13,
                adapter="sql-lora" if i % 4 == 0 else None,
                arrival=0.0,
            )
        )
    now = 0.0
    for _ in range(10):
        now = engine.step(now).end
    http = HttpStats()
    for handler in ("/v1/chat/completions", "/v1/completions", "/metrics", "/health"):
        http.observe(
            handler=handler,
            method="POST" if handler.startswith("/v1") else "GET",
            status=200,
            duration_s=0.05,
            request_bytes=400,
            response_bytes=3000,
        )
    return render_metrics(
        engine,
        flavour=Flavour.VLLM,
        model_name=_MODEL,
        lora_enabled=True,
        unix_offset=time.time() - now,
        http=http,
    )


_PADDING = (
    # (family, labels, bucket bounds): histogram families of the kind a newer vLLM serves.
    ("vllm:time_per_output_token_seconds", True, (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
     0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)),
    ("vllm:kv_block_lifetime_seconds", True, (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
     0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)),
    ("vllm:kv_block_idle_before_evict_seconds", True, (0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
     0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)),
    ("vllm:kv_block_reuse_gap_seconds", True, (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
     0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)),
    ("vllm:request_prefill_kv_computed_tokens", True, (1.0, 2.0, 5.0, 10.0, 20.0, 50.0,
     100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0)),
)  # fmt: skip


def synthetic_page(base: str, *, lines: int = 628, min_bytes: int = 59_000) -> str:
    """`base` padded with histogram families (and per-handler HTTP duration histograms)
    before `vllm:cache_config_info`, until it has `lines` lines and `min_bytes` bytes."""
    padding: list[str] = []
    index = 0
    while True:
        current_lines = base.count("\n") + len(padding)
        current_bytes = len(base.encode()) + sum(len(line) + 1 for line in padding)
        if current_lines >= lines and current_bytes >= min_bytes:
            break
        name, labelled, bounds = _PADDING[index % len(_PADDING)]
        round_ = index // len(_PADDING)
        if round_:
            name = f"http_request_duration_seconds_{round_}"
            labelled = False
        label = f'engine="0",model_name="{_MODEL}"' if labelled else 'handler="/v1/models"'
        padding.append(f"# HELP {name} Padding, shaped like a real page's histograms.")
        padding.append(f"# TYPE {name} histogram")
        for k, bound in enumerate((*bounds, float("inf"))):
            le = "+Inf" if bound == float("inf") else repr(bound)
            padding.append(f'{name}_bucket{{{label},le="{le}"}} {float(3 * k)}')
        padding.append(f"{name}_count{{{label}}} {float(3 * len(bounds))}")
        padding.append(f"{name}_sum{{{label}}} 1234.5678")
        index += 1
    at = base.index("# HELP vllm:cache_config_info")
    return base[:at] + "\n".join(padding) + "\n" + base[at:]


# -- parse cost ----------------------------------------------------------------------------


def _cpu_per_call(function: Callable[[], object], *, min_seconds: float) -> float:
    """CPU seconds per call of `function`, measured with process_time over enough calls."""
    function()  # warm caches (compiled patterns)
    calls = 0
    started = time.process_time()
    while True:
        function()
        calls += 1
        elapsed = time.process_time() - started
        if elapsed >= min_seconds:
            return elapsed / calls


def parse_cost(text: str, *, min_seconds: float) -> dict[str, float]:
    adapter = engine_adapter("vllm")
    families = adapter.families
    fast = _cpu_per_call(lambda: parse_samples(text, families), min_seconds=min_seconds)
    fast_adapter = _cpu_per_call(lambda: adapter.parse(text), min_seconds=min_seconds)
    full = _cpu_per_call(
        lambda: list(text_string_to_metric_families(text)), min_seconds=min_seconds
    )
    return {
        "fast_parse_us": fast * 1e6,
        "fast_parse_and_adapter_us": fast_adapter * 1e6,
        "full_parse_us": full * 1e6,
        "full_over_fast": full / fast_adapter,
    }


# -- whole scrapes -------------------------------------------------------------------------


async def _serve(kind: str, pods: int) -> None:
    """Child process: serve `pods` metrics pages on loopback until stdin closes. The
    synthetic page is sent gzipped to a client that asks for it (pre-compressed: the pod's
    cost of compressing is not what is measured here)."""
    async with AsyncExitStack() as stack:
        urls: list[str] = []
        if kind == "simulator":
            for i in range(pods):
                pod = await stack.enter_async_context(
                    SimulatedPod(f"pod-{i}", adapters=("sql-lora",), seed=i)
                )
                urls.append(pod.url + "/metrics")
        else:
            page = synthetic_page(simulator_page())
            body = page.encode()
            compressed = gzip.compress(body, compresslevel=6)
            restricted: dict[tuple[str, ...], bytes] = {}

            async def metrics(request: web.Request) -> web.Response:
                names = tuple(sorted(request.query.getall("name[]", [])))
                if names:  # as prometheus-client (vLLM's exporter) answers `name[]`
                    if names not in restricted:
                        restricted[names] = restrict_page(page, names).encode()
                    return web.Response(body=restricted[names], content_type="text/plain")
                if "gzip" in request.headers.get("Accept-Encoding", ""):
                    return web.Response(
                        body=compressed,
                        content_type="text/plain",
                        headers={"Content-Encoding": "gzip"},
                    )
                return web.Response(body=body, content_type="text/plain")

            app = web.Application()
            app.router.add_get("/metrics", metrics)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            for _ in range(pods):
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
            urls = [f"http://127.0.0.1:{address[1]}/metrics" for address in runner.addresses]
        print("READY " + " ".join(urls), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def _scrape(
    urls: list[str], *, interval_s: float, seconds: float, compress: bool, by_name: bool
) -> dict[str, float]:
    scrapes = 0
    errors: list[str] = []

    def counted(pod_id: str, duration_s: float) -> None:
        nonlocal scrapes
        scrapes += 1

    store = MetricsStore()
    async with Scraper(
        store,
        interval_s=interval_s,
        timeout_s=5.0,
        compress=compress,
        observe_scrape=counted,
        observe_error=lambda pod_id, kind: errors.append(kind.value),
        seed=0,
    ) as scraper:
        scraper.set_targets(
            {f"pod-{i}": ScrapeTarget(url=url, by_name=by_name) for i, url in enumerate(urls)}
        )
        await asyncio.sleep(max(0.5, 2 * interval_s))  # connections opened, phases spread
        first, cpu, times, wall = scrapes, time.process_time(), os.times(), time.perf_counter()
        await asyncio.sleep(seconds)
        done = scrapes - first
        cpu = time.process_time() - cpu
        user = os.times().user - times.user
        system = os.times().system - times.system
        wall = time.perf_counter() - wall
    if errors or not done:
        raise RuntimeError(f"Scrapes failed during the benchmark: {errors[:5]} ({done} done).")
    per_scrape = cpu / done
    return {
        "pods": len(urls),
        "interval_s": interval_s,
        "gzip": compress,
        "by_name": by_name,
        "scrapes": done,
        "scrapes_per_s": done / wall,
        "cpu_ms_per_scrape": per_scrape * 1e3,
        "user_ms_per_scrape": user / done * 1e3,
        "system_ms_per_scrape": system / done * 1e3,
        "pod_hz_per_core": 1.0 / per_scrape,
        "cpu_share_of_one_core": cpu / wall,
    }


def scrape_cost(
    kind: str,
    *,
    pods: int,
    interval_s: float,
    seconds: float,
    compress: bool = False,
    by_name: bool = False,
) -> dict[str, float]:
    """Start the pods in a child process, scrape them here, stop the child."""
    path = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", kind, "--pods", str(pods)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    try:
        assert child.stdout is not None
        ready = child.stdout.readline().split()
        if not ready or ready[0] != "READY":
            raise RuntimeError(f"The pod process did not start (it said {ready!r}).")
        return asyncio.run(
            _scrape(
                ready[1:],
                interval_s=interval_s,
                seconds=seconds,
                compress=compress,
                by_name=by_name,
            )
        )
    finally:
        if child.stdin is not None:
            child.stdin.close()  # the child's signal to stop
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# -- report --------------------------------------------------------------------------------


def _interval_table(cpu_ms: float) -> list[dict[str, float]]:
    """Share of one core that scraping takes, per fleet size and interval."""
    return [
        {
            "pods": pods,
            "interval_s": interval,
            "cpu_share_of_one_core": pods / interval * cpu_ms / 1e3,
        }
        for pods in (100, 200, 1000)
        for interval in (0.1, 0.25, 1.0)
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = simulator_page()
    pages = {"simulator": base, "synthetic": synthetic_page(base)}
    results: dict[str, Any] = {"target_cpu_ms_per_scrape": TARGET_CPU_MS, "pages": {}}
    for kind, text in pages.items():
        results["pages"][kind] = {
            "bytes": len(text.encode()),
            "gzip_bytes": len(gzip.compress(text.encode(), compresslevel=6)),
            "lines": text.count("\n"),
            "parse": parse_cost(text, min_seconds=0.1 if args.quick else 1.0),
        }
    runs = [
        ("simulator", "scrape", {}),
        ("synthetic", "scrape", {}),
        ("synthetic", "scrape_gzip", {"compress": True}),
        ("synthetic", "scrape_by_name", {"by_name": True}),
    ]
    for kind, key, options in runs:
        results["pages"][kind][key] = scrape_cost(
            kind, pods=args.pods, interval_s=args.interval, seconds=args.seconds, **options
        )
    heavy = results["pages"]["synthetic"]["scrape"]["cpu_ms_per_scrape"]
    results["interval_table"] = _interval_table(heavy)
    return results


_SCRAPE_LABELS = {
    "scrape": "scrape:     ",
    "scrape_gzip": "gzip:       ",
    "scrape_by_name": "by name[]:  ",
}


def _print(results: dict[str, Any]) -> None:
    target = 1000 / results["target_cpu_ms_per_scrape"]
    for kind, page in results["pages"].items():
        parse = page["parse"]
        print(
            f"{kind} vLLM page: {page['bytes'] / 1000:.1f} KB ({page['gzip_bytes'] / 1000:.1f} KB "
            f"gzipped), {page['lines']} lines"
        )
        print(
            f"  parse only:  fast {parse['fast_parse_us']:.0f} µs, with the vLLM adapter "
            f"{parse['fast_parse_and_adapter_us']:.0f} µs; prometheus-client "
            f"{parse['full_parse_us'] / 1000:.2f} ms ({parse['full_over_fast']:.0f}x)"
        )
        for key, label in _SCRAPE_LABELS.items():
            if key not in page:
                continue
            scrape = page[key]
            print(
                f"  {label}"
                f"{scrape['cpu_ms_per_scrape']:.3f} ms CPU per pod scrape "
                f"(user {scrape['user_ms_per_scrape']:.3f}, kernel "
                f"{scrape['system_ms_per_scrape']:.3f}) at {scrape['scrapes_per_s']:,.0f} "
                f"scrapes/s ({scrape['pods']} pods every {scrape['interval_s']:g} s): "
                f"{scrape['pod_hz_per_core']:,.0f} pod-scrapes/s per core (target {target:,.0f})"
            )
    print("share of one core spent scraping 59 KB pages, at the measured cost:")
    for row in results["interval_table"]:
        print(
            f"  {row['pods']:>5} pods every {row['interval_s']:>4g} s: "
            f"{100 * row['cpu_share_of_one_core']:6.1f}%"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--pods", type=int, default=200, help="simulated pods (default 200)")
    parser.add_argument("--interval", type=float, default=0.1, help="scrape interval (0.1 s)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured time per run")
    parser.add_argument("--quick", action="store_true", help="shorter parse measurements")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--serve", choices=("simulator", "synthetic"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve, args.pods))
        return 0
    results = run(args)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
