"""The benchmark process's garbage collector, kept from pausing a replay.

The simulated pods and, for the Envoy-fronted policies, the xDS server run in the
benchmark's own process. A full collection walks every object the collector tracks (the
imported modules and protobuf descriptors alone are ~80,000: ~100 ms here), and while it runs
no pod steps and the server decides nothing: the pause lands on the TTFT of every request in
flight. Earlier runs show it as the simulator's `max_step_lag_s` of 100-290 ms in scenarios
b, e and h, in some runs of a seed and not in others. What exists when a replay starts lives
through it, so `collector_frozen` moves it out of the collector's sight (`gc.freeze`) for
the replay and records the collections that still happen.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["CollectorPauses", "collector_frozen"]


@dataclass
class CollectorPauses:
    """The garbage collections during a replay (mutable: counted as they happen)."""

    count: int = 0
    longest_s: float = 0.0
    total_s: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {"count": self.count, "longest_s": self.longest_s, "total_s": self.total_s}


@contextlib.contextmanager
def collector_frozen() -> Iterator[CollectorPauses]:
    """Collect once, freeze what survives, and count the collections until the block ends;
    then hand the frozen objects back to the collector."""
    pauses = CollectorPauses()
    started_at: float | None = None

    def on_collection(phase: str, _info: dict[str, Any]) -> None:
        nonlocal started_at
        if phase == "start":
            started_at = time.perf_counter()
        elif started_at is not None:
            pause = time.perf_counter() - started_at
            pauses.count += 1
            pauses.longest_s = max(pauses.longest_s, pause)
            pauses.total_s += pause
            started_at = None

    gc.collect()
    gc.freeze()
    gc.callbacks.append(on_collection)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(on_collection)
        gc.unfreeze()
