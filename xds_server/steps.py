"""Work in steps: long pure computations that let the event loop breathe.

At fleet size a decision or a build can take tens of milliseconds, and one event loop
also runs every ADS stream, ACK, load report and health probe. So the long pure functions
(`policy.Decider.steps`, `snapshot_builder.SnapshotBuilder.build_steps`) are generators that
yield between pieces of work (a pool, a batch of Envoys): the controller drives them,
handing the loop back whenever a slice has run long enough, and a test or a one-off caller
runs them to the end with `complete`. Yielding changes nothing in the result.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeAlias, TypeVar

__all__ = ["Steps", "complete"]

T = TypeVar("T")

Steps: TypeAlias = Generator[None, None, T]


def complete(steps: Steps[T]) -> T:
    """Run `steps` to the end at once and return what they return."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
