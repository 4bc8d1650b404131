"""Running the load generator in its own process, and its command line.

The benchmark runs the simulated pods, Envoy and the load generator on one small machine.
Within one Python process the pods' engine loops and the generator's sends would share an
event loop and a GIL, so a slow engine step would make requests late and a burst of sends
would slow the pods: each side would measure the other. So the benchmark starts
`python -m llm_sim.loadgen TRACE --url ...` (this module's `main`) and reads the
results back from a JSON file, which round-trips exactly (`ReplayResult.load`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llm_sim.loadgen.errors import LoadgenError, ReplayFailedError, TraceFormatError
from llm_sim.loadgen.replay import DEFAULT_BAND_HEADER, replay
from llm_sim.loadgen.results import ReplayResult
from llm_sim.loadgen.stats import summarize
from llm_sim.loadgen.trace import Trace

__all__ = ["main", "run_replay_in_subprocess"]

logger = logging.getLogger(__name__)


async def run_replay_in_subprocess(
    trace_path: Path,
    *,
    url: str,
    timeout_s: float,
    max_in_flight: int,
    time_scale: float = 1.0,
    stream_options_usage: bool = True,
    band_header: str = DEFAULT_BAND_HEADER,
    prompt_salt: str = "",
    extra_headers: Mapping[str, str] | None = None,
    extra_body: Mapping[str, Any] | None = None,
    cache_key_session: bool = False,
    results_path: Path | None = None,
    wait_timeout_s: float | None = None,
    python: str = sys.executable,
) -> ReplayResult:
    """Run `replay` on the trace at `trace_path` in a child `python -m llm_sim.loadgen`.

    The options are `replay`'s; `extra_headers` go on every request (a callable cannot
    cross the process boundary). Results are written to `results_path` (kept) or to a
    temporary file (removed). The child is killed if it runs longer than `wait_timeout_s`
    (default: the trace's duration * time_scale + timeout_s + 60 s) or if this coroutine is
    cancelled. Raises ReplayFailedError when the child fails, with its stderr's end.
    """
    if wait_timeout_s is None:
        wait_timeout_s = _trace_duration(trace_path) * time_scale + timeout_s + 60.0
    with tempfile.TemporaryDirectory(prefix="loadgen-") as scratch:
        output = results_path if results_path is not None else Path(scratch) / "results.json"
        argv = [
            python,
            "-m",
            "llm_sim.loadgen",
            str(trace_path),
            "--url",
            url,
            "--timeout-s",
            repr(timeout_s),
            "--max-in-flight",
            str(max_in_flight),
            "--time-scale",
            repr(time_scale),
            "--band-header",
            band_header,
            "--prompt-salt",
            prompt_salt,
            "--output",
            str(output),
        ]
        if not stream_options_usage:
            argv.append("--no-usage")
        for name, value in (extra_headers or {}).items():
            argv += ["--header", f"{name}: {value}"]
        if extra_body:
            argv += ["--extra-body", json.dumps(dict(extra_body))]
        if cache_key_session:
            argv.append("--cache-key-session")
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        logger.info("Started the load generator, pid %d, on %s.", process.pid, trace_path)
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), wait_timeout_s)
        except TimeoutError as exc:
            raise ReplayFailedError(
                f"The load generator (pid {process.pid}) ran longer than {wait_timeout_s:.0f} s"
                " and was killed."
            ) from exc
        finally:
            if process.returncode is None:
                process.kill()
                await asyncio.shield(process.wait())
        if process.returncode != 0:
            tail = stderr.decode(errors="replace")[-2000:]
            raise ReplayFailedError(
                f"The load generator exited with status {process.returncode}: {tail}"
            )
        return ReplayResult.load(output)


def _trace_duration(trace_path: Path) -> float:
    """The trace's `duration_s`, read from its header line only."""
    try:
        with trace_path.open(encoding="utf-8") as file:
            header = json.loads(file.readline())
        return float(header["spec"]["duration_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TraceFormatError(f"{trace_path}: cannot read the trace header: {exc}") from exc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llm_sim.loadgen",
        description="Replay a trace open loop against an OpenAI-compatible endpoint.",
    )
    parser.add_argument("trace", type=Path, help="trace file (JSON lines, from Trace.save)")
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--timeout-s", type=float, required=True, help="per-request timeout")
    parser.add_argument("--max-in-flight", type=int, required=True, help="safety cap")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--no-usage", action="store_true", help="omit stream_options")
    parser.add_argument("--band-header", default=DEFAULT_BAND_HEADER)
    parser.add_argument("--prompt-salt", default="")
    parser.add_argument(
        "--header", action="append", default=[], help="'name: value', on every request"
    )
    parser.add_argument("--extra-body", default=None, help="JSON object merged into bodies")
    parser.add_argument(
        "--cache-key-session",
        action="store_true",
        help="send prompt_cache_key as x-session-id when a request has no session",
    )
    parser.add_argument("--output", default="-", help="results JSON file, '-' for stdout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: replay, write the results JSON, log a one-line summary; 0 on success."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            parser.error(f"--header {item!r} is not 'name: value'")
        headers[name.strip().lower()] = value.strip()
    extra_body: Any = None
    if args.extra_body:
        try:
            extra_body = json.loads(args.extra_body)
        except ValueError:
            extra_body = None
        if not isinstance(extra_body, dict):
            parser.error("--extra-body must be a JSON object")
    try:
        trace = Trace.load(args.trace)
        # The trace and everything imported live as long as the replay: out of the
        # collector's sight, a full collection does not stall the loop that times responses.
        gc.freeze()
        result = asyncio.run(
            replay(
                trace,
                url=args.url,
                timeout_s=args.timeout_s,
                max_in_flight=args.max_in_flight,
                headers_for=(lambda _: headers) if headers else None,
                time_scale=args.time_scale,
                stream_options_usage=not args.no_usage,
                band_header=args.band_header,
                prompt_salt=args.prompt_salt,
                extra_body=extra_body,
                cache_key_session=args.cache_key_session,
            )
        )
    except LoadgenError as exc:
        logger.critical("%s", exc)
        return 1
    if args.output == "-":
        sys.stdout.write(result.dumps() + "\n")
    else:
        result.save(Path(args.output))
    summary = summarize(result.results, duration_s=max(result.duration_s, 1e-9))
    logger.info(
        "Replayed %d requests in %.1f s: %s; TTFT p99 %s s; saturated=%s.",
        summary.requests,
        result.duration_s,
        summary.status_counts,
        summary.ttft_p99_s,
        result.saturated,
    )
    return 0
