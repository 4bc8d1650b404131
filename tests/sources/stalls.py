"""How long the event loop stops answering while a config is parsed, and the documents that
tried to make it stop (the issue's attacks, and one that takes its time within every cap).

The loop is shared by ADS, LRS, the scrapes and the admin server; the test of each source
runs a ticker (a 5 ms sleep, over and over: how late it wakes is how long the loop was
held) and a health probe against the admin server while the server refuses a document.
A busy 2-core CI machine can hold a process off its core for a while now and then, so
`least_stalls` tries up to three times and keeps the best: parsing on the loop, or in a
thread, stalls it for hundreds of milliseconds on every try (measured: 257 ms and up for
1 MiB in a thread, seconds on the loop), which no retry hides.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp

__all__ = [
    "BOUND_S",
    "Stalls",
    "alias_bomb",
    "giant_document",
    "least_stalls",
    "measuring_stalls",
    "slow_document",
]

# The longest the loop may stop answering while a hostile config is parsed.
BOUND_S = 0.1

_TICK_S = 0.005


@dataclass
class Stalls:
    """The worst seen: how late a 5 ms sleep woke, and the slowest health probe."""

    tick_s: float = 0.0
    probe_s: float = 0.0
    probes: int = 0

    @property
    def worst_s(self) -> float:
        return max(self.tick_s, self.probe_s)


@contextlib.asynccontextmanager
async def measuring_stalls(*, probe_url: str | None = None) -> AsyncIterator[Stalls]:
    """While entered, tick (and GET `probe_url`, expecting 200, every 20 ms)."""
    stalls = Stalls()
    loop = asyncio.get_running_loop()

    async def tick() -> None:
        while True:
            before = loop.time()
            await asyncio.sleep(_TICK_S)
            stalls.tick_s = max(stalls.tick_s, loop.time() - before - _TICK_S)

    async def probe(url: str) -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                before = loop.time()
                async with http.get(url) as response:
                    await response.read()
                    assert response.status == 200
                stalls.probe_s = max(stalls.probe_s, loop.time() - before)
                stalls.probes += 1
                await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(tick())]
    if probe_url is not None:
        tasks.append(asyncio.create_task(probe(probe_url)))
    try:
        yield stalls
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def least_stalls(
    attempt: Callable[[int], Awaitable[None]],
    *,
    probe_url: str | None = None,
    attempts: int = 3,
) -> Stalls:
    """Run `attempt(0)`, `attempt(1)`, ... while measuring, until one stays within BOUND_S;
    return the best measurement (the test asserts on it)."""
    best: Stalls | None = None
    for i in range(attempts):
        async with measuring_stalls(probe_url=probe_url) as stalls:
            await attempt(i)
        if best is None or stalls.worst_s < best.worst_s:
            best = stalls
        if best.worst_s < BOUND_S:
            break
    assert best is not None
    return best


def alias_bomb(aliases: int = 1000) -> str:
    """8 KB of aliases that validation walks at every use: `aliases` pools of `aliases`
    endpoints each. Before alias limits, 1000 took 7.5 s of validation (on the loop)."""
    return (
        "e: &e {address: 10.0.0.1, port: 80}\n"
        f"p: &p {{name: a, models: [m], endpoints: [{', '.join(['*e'] * aliases)}]}}\n"
        f"pools: [{', '.join(['*p'] * aliases)}]\n"
    )


def _endpoints(count: int) -> str:
    return "".join(
        f"      - {{address: 10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}, port: 8000}}\n"
        for i in range(count)
    )


@functools.cache
def giant_document(megabytes: int) -> bytes:
    """A valid-looking routing config of about `megabytes` MB (one pool, many endpoints)."""
    head = "pools:\n  - name: a\n    models: [m]\n    endpoints:\n"
    return (head + _endpoints(megabytes * 20_000)).encode()


def slow_document(max_bytes: int = 1 << 20) -> bytes:
    """Within every limit (just under `max_bytes`, no aliases), costly to parse (about a
    second of CPU), and invalid only at its very end: an endpoint listed twice."""
    head = "pools:\n  - name: a\n    models: [m]\n    endpoints:\n"
    line = "      - {address: 10.0.0.0, port: 8000}\n"
    body = _endpoints((max_bytes - len(head) - len(line)) // 50)
    document = head + body + line
    assert len(document) <= max_bytes
    return document.encode()
