"""The clock seam: where time enters the server.

Every component that reads the time takes a `Clock` (keyword `clock`), so a test can pass a
fake one. The default is the running event loop's clock, the same clock `asyncio.sleep`
and `asyncio.timeout` wait on: a component that both reads the time and sleeps stays
consistent with itself, and a test that fast-forwards the loop's time (looptime) moves both.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["Clock", "loop_clock"]


class Clock(Protocol):
    """Monotonic seconds: only differences between two readings mean anything."""

    def __call__(self) -> float: ...


def loop_clock() -> float:
    """The running event loop's time (raises RuntimeError outside a running loop)."""
    return asyncio.get_running_loop().time()
