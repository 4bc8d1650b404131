"""What the fleet benchmark reads off the server process: its CPU time and its own metrics.

CPU comes from `/proc/<pid>/stat` (user + system time of every thread, in clock ticks), not
from the server's `process_cpu_seconds_total`: the figure must not depend on what the server
chooses to export, and reading a file costs the server nothing. Everything else comes from
the admin `/metrics` page, read with the server's own fast exposition reader for the few
families wanted. Reading the page costs the server a render of every series (a few
milliseconds with hundreds of pods), so the harness reads it at most twice a second.

The event-loop lag metrics (`xds_event_loop_lag_seconds`, `xds_event_loop_lag_max_seconds`)
may be missing from an older server: then the readings say None and the figures built on
them are null, and nothing fails.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import aiohttp

from xds_server.metrics.exposition import Sample, parse_samples

__all__ = ["ServerProbe", "ServerReading", "cpu_seconds", "stall_bound"]

_LAG = "xds_event_loop_lag_seconds"
_LAG_MAX = "xds_event_loop_lag_max_seconds"
_SCRAPES = "xds_scrape_duration_seconds"
_AGE = "xds_pod_metrics_age_seconds"
_NACKS = "xds_nacks"
_STREAMS = "xds_connected_streams"
_FAMILIES = frozenset({_LAG, _LAG_MAX, _SCRAPES, _AGE, _NACKS, _STREAMS})
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (all its threads; not children)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) is in parentheses and may hold blanks: split after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


@dataclass(frozen=True, kw_only=True)
class ServerReading:
    """One read of the server at monotonic time `at`: its CPU seconds, and from /metrics
    the event-loop lag histogram (cumulative counts by upper bound, None when absent) and
    largest lag, the successful scrapes so far, each scraped pod's metrics age, NACKs and
    open ADS streams."""

    at: float
    cpu_s: float
    lag_buckets: tuple[tuple[float, float], ...] | None
    lag_max_s: float | None
    scrapes: float
    pod_ages_s: tuple[float, ...]
    nacks: float
    streams: float

    @classmethod
    def parse(cls, text: str, *, at: float, cpu_s: float) -> ServerReading:
        """The reading of the server's /metrics page `text`, taken at `at` with `cpu_s`."""
        samples = parse_samples(text, _FAMILIES, max_samples=1_000_000, max_labels=10_000_000)
        return _reading(at, cpu_s, samples)

    def stalls_over(self, bound_s: float) -> int | None:
        """Lag samples above `bound_s` (a bucket bound) so far; None without the histogram."""
        if self.lag_buckets is None:
            return None
        counts = dict(self.lag_buckets)
        if bound_s not in counts:
            return None
        return round(counts[math.inf] - counts[bound_s])


def stall_bound(before: ServerReading, after: ServerReading) -> float | None:
    """An upper bound of the longest event-loop stall between two readings: the upper
    bound of the highest lag bucket that gained samples, or the server's largest lag
    since it started (the gauge) when that is lower; 0.0 when no sample was taken, None
    when the server does not export the histogram."""
    if before.lag_buckets is None or after.lag_buckets is None:
        return None
    grown = _per_bucket(after.lag_buckets, before.lag_buckets)
    for bound, count in reversed(grown):
        if count > 0:
            return bound if after.lag_max_s is None else min(bound, after.lag_max_s)
    return 0.0


def _per_bucket(
    after: Sequence[tuple[float, float]], before: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Samples that fell in each bucket (not cumulative) between two readings."""
    earlier = dict(before)
    result = []
    below_after = below_before = 0.0
    for bound, cumulative in after:
        previous = earlier.get(bound, 0.0)
        result.append((bound, (cumulative - below_after) - (previous - below_before)))
        below_after, below_before = cumulative, previous
    return result


class ServerProbe:
    """Reads the server at `pid` and its admin `/metrics` at `admin_url`. Use `async with`
    (it holds one HTTP session)."""

    def __init__(self, *, pid: int, admin_url: str) -> None:
        self._pid = pid
        self._url = f"{admin_url}/metrics"
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ServerProbe:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._http is not None:
            await self._http.close()

    def cpu_s(self) -> float:
        return cpu_seconds(self._pid)

    async def read(self) -> ServerReading:
        """CPU now, then /metrics."""
        if self._http is None:
            raise RuntimeError("The ServerProbe is not open; use `async with`.")
        at, cpu = time.monotonic(), self.cpu_s()
        async with self._http.get(self._url) as response:
            response.raise_for_status()
            text = await response.text()
        return ServerReading.parse(text, at=at, cpu_s=cpu)


def _reading(at: float, cpu: float, samples: Sequence[Sample]) -> ServerReading:
    buckets: list[tuple[float, float]] = []
    lag_max = None
    scrapes = nacks = streams = 0.0
    ages: list[float] = []
    for sample in samples:
        name, labels, value = sample
        if name == f"{_LAG}_bucket":
            buckets.append((_bound(labels), value))
        elif name == _LAG_MAX:
            lag_max = value
        elif name == f"{_SCRAPES}_count":
            scrapes = value
        elif name == _AGE:
            ages.append(value)
        elif name == f"{_NACKS}_total":
            nacks += value
        elif name == _STREAMS:
            streams += value
    return ServerReading(
        at=at,
        cpu_s=cpu,
        lag_buckets=tuple(sorted(buckets)) if buckets else None,
        lag_max_s=lag_max,
        scrapes=scrapes,
        pod_ages_s=tuple(ages),
        nacks=nacks,
        streams=streams,
    )


def _bound(labels: Mapping[str, str]) -> float:
    return float(labels["le"])  # "+Inf" parses as inf
