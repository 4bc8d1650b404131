"""How long the event loop is kept from everything else: the server's own stall meter.

One thread runs every ADS stream, scrape, load report and health probe; a long build or
parse on it delays them all. A timer that should fire every `interval_s` measures how late
it fires (`xds_event_loop_lag_seconds`), which is how long the loop was held: the figure
the fleet benchmark's `loop_stall_max_s` reads and an operator can alert on.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from xds_server.telemetry.registry import Telemetry

__all__ = ["LOOP_LAG_INTERVAL_S", "timing_gc", "watch_loop_lag"]

# Often enough to see a 50 ms stall, seldom enough to cost nothing (20 wake-ups a second).
LOOP_LAG_INTERVAL_S = 0.05


async def watch_loop_lag(
    telemetry: Telemetry,
    *,
    interval_s: float = LOOP_LAG_INTERVAL_S,
    _iterations: int | None = None,
) -> None:
    """Sleep `interval_s` at a time and record how much later than asked each wake-up came,
    until cancelled (or `_iterations` wake-ups, in tests)."""
    loop = asyncio.get_running_loop()
    largest = 0.0
    done = 0
    while _iterations is None or done < _iterations:
        done += 1
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag = max(0.0, loop.time() - asked)
        telemetry.loop_lag.observe(lag)
        if lag > largest:
            largest = lag
            telemetry.loop_lag_max.set(lag)


@contextlib.contextmanager
def timing_gc(telemetry: Telemetry) -> Iterator[None]:
    """Within: every pause of the cyclic garbage collector is recorded
    (`xds_gc_pause_seconds{generation}`), the one stall the loop-lag timer cannot name."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pause = time.perf_counter() - started.pop()
            telemetry.gc_pause.labels(str(info.get("generation", ""))).observe(pause)

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)
