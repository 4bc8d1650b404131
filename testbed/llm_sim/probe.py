"""A closed-loop saturation probe: how much does an OpenAI endpoint actually sustain?

Used to calibrate the simulator against its own analytic model (`nominal_capacity`): drive
one pod (or anything behind a URL) with more concurrent clients than it can run, all sending
the same request shape, and count what comes back. Two details make the number honest:

- prompts are unique per request (no prefix-cache hits flatter the result);
- clients start spread over `ramp_s`, so requests' phases are spread as in steady state,
  and only what completes inside the window after `warmup_s` counts. Tokens are counted
  as they arrive, so the token rate needs no whole number of request lifetimes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

__all__ = ["ProbeResult", "saturation_probe"]


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """What the window saw: completed requests and received output tokens per second,
    plus counts (errors are non-200 responses or broken streams)."""

    requests_per_s: float
    output_tokens_per_s: float
    completed: int
    output_tokens: int
    window_s: float
    errors: int


async def saturation_probe(
    url: str,
    *,
    model: str,
    prompt_tokens: int,
    output_tokens: int,
    concurrency: int,
    warmup_s: float,
    window_s: float,
    ramp_s: float = 0.0,
    shapes: Sequence[tuple[int, int]] = (),
) -> ProbeResult:
    """Run `concurrency` streaming clients against `url` (`.../v1/chat/completions`) for
    `warmup_s + window_s` seconds and measure the window.

    Every request has `prompt_tokens` and `output_tokens`, unless `shapes` lists (prompt,
    output) pairs: then the requests take them in turn, so that a workload's own mix of
    lengths (whose long requests weigh on every step of a batch) is what is measured."""
    loop = asyncio.get_running_loop()
    begin = loop.time()
    window_start = begin + warmup_s
    window_end = window_start + window_s
    completed = 0
    tokens = 0
    errors = 0
    turns = itertools.cycle(shapes)

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal completed, tokens, errors
        await asyncio.sleep(ramp_s * index / concurrency)
        sequence = 0
        while loop.time() < window_end:
            sequence += 1
            prompt, output = next(turns) if shapes else (prompt_tokens, output_tokens)
            words = " ".join(f"c{index}r{sequence}w{k}" for k in range(prompt))
            body = {
                "model": model,
                "messages": [{"role": "user", "content": words}],
                "max_tokens": output,
                "stream": True,
            }
            received = 0
            try:
                async with session.post(url, json=body) as response:
                    if response.status != 200:
                        errors += 1
                        await response.read()
                        continue
                    async for line in response.content:
                        if not line.startswith(b"data: {"):
                            continue
                        choice = json.loads(line[6:])["choices"][0]
                        count = len(choice["delta"].get("content", "").split())
                        received += count
                        now = loop.time()
                        if window_start <= now < window_end:
                            tokens += count
            except (TimeoutError, aiohttp.ClientError):
                errors += 1
                continue
            now = loop.time()
            if received != output:
                errors += 1
            elif window_start <= now < window_end:
                completed += 1

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector) as session:
        workers = [asyncio.create_task(client(i, session)) for i in range(concurrency)]
        # Clients finish the request in flight at the window's end; nobody waits for them.
        await asyncio.sleep(max(0.0, window_end - loop.time()))
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return ProbeResult(
        requests_per_s=completed / window_s,
        output_tokens_per_s=tokens / window_s,
        completed=completed,
        output_tokens=tokens,
        window_s=window_s,
        errors=errors,
    )
