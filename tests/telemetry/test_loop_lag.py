"""The server's stall meter: a blocked event loop and a collector pause are measured."""

from __future__ import annotations

import asyncio
import gc
import time

from xds_server.telemetry import Telemetry
from xds_server.telemetry.loop_lag import timing_gc, watch_loop_lag


async def test_a_blocked_loop_is_measured_as_lag() -> None:
    telemetry = Telemetry()
    watcher = asyncio.create_task(watch_loop_lag(telemetry, interval_s=0.01, _iterations=3))
    await asyncio.sleep(0)  # the watcher's first sleep is armed
    time.sleep(0.2)  # noqa: ASYNC251  # the stall being measured: nothing else runs
    await asyncio.wait_for(watcher, 10)
    registry = telemetry.registry
    assert (registry.get_sample_value("xds_event_loop_lag_max_seconds") or 0) >= 0.15
    assert registry.get_sample_value("xds_event_loop_lag_seconds_count") == 3
    # The stall is in the buckets above 0.1 s, not below.
    below = registry.get_sample_value("xds_event_loop_lag_seconds_bucket", {"le": "0.1"})
    assert below is not None and below <= 2


def test_garbage_collector_pauses_are_recorded_by_generation() -> None:
    telemetry = Telemetry()
    with timing_gc(telemetry):
        gc.collect()
    count = telemetry.registry.get_sample_value(
        "xds_gc_pause_seconds_count", {"generation": "2"}
    )
    assert count is not None and count >= 1
    # Outside the context nothing more is recorded.
    gc.collect()
    assert (
        telemetry.registry.get_sample_value("xds_gc_pause_seconds_count", {"generation": "2"})
        == count
    )
