"""Every exception the load generator raises on purpose.

    LoadgenError             the load generator could not do what it was asked
    ├── TraceFormatError     a trace or results file that cannot be read back
    └── ReplayFailedError    the replay subprocess exited without results

Per-request failures (refusals, resets, timeouts) are not exceptions: they are measurements,
recorded in each `RequestResult`, because a benchmark has to count them, not stop on them.
"""

from __future__ import annotations

__all__ = ["LoadgenError", "ReplayFailedError", "TraceFormatError"]


class LoadgenError(Exception):
    """Base of the load generator's own errors."""


class TraceFormatError(LoadgenError, ValueError):
    """A trace or results document that is not in the format this module writes."""


class ReplayFailedError(LoadgenError):
    """The replay subprocess failed; the message carries the end of its stderr."""
