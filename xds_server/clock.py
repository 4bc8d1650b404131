"""The clock seam: where time enters the server.

Every component that reads the time takes a `Clock` (keyword `clock`), so a test can pass a
fake one. The default is the running event loop's clock, the same clock `asyncio.sleep`
and `asyncio.timeout` wait on: a component that both reads the time and sleeps stays
consistent with itself, and a test that fast-forwards the loop's time (looptime) moves both.
Work handed to a worker thread with `to_thread` reads the clock of the loop that handed it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar

__all__ = ["Clock", "loop_clock", "to_thread"]

P = ParamSpec("P")
T = TypeVar("T")

# The loop whose clock a worker thread reads (set by `to_thread`, carried by the context).
_HANDED_FROM: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "handed_from", default=None
)


class Clock(Protocol):
    """Monotonic seconds: only differences between two readings mean anything."""

    def __call__(self) -> float: ...


def loop_clock() -> float:
    """The running event loop's time, or in a worker thread started by `to_thread` that
    loop's (raises RuntimeError elsewhere outside a running loop)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        loop = _HANDED_FROM.get()
        if loop is None:
            raise
        return loop.time()


async def to_thread(function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`asyncio.to_thread`, with `loop_clock` reading this loop's time in the thread."""
    token = _HANDED_FROM.set(asyncio.get_running_loop())
    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    finally:
        _HANDED_FROM.reset(token)
