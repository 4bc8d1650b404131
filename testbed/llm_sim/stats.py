"""Histograms with vLLM's own bucket boundaries, kept by the engine and rendered by
`metrics_text`.

The bucket lists are vLLM v1's (`vllm/v1/metrics/loggers.py`), so a simulated page has the
same `le` labels as a real one and a parser or dashboard written against one reads the
other. Pure and tiny: a histogram is a sorted tuple of upper bounds plus counts.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = [
    "Histogram",
    "ITERATION_TOKEN_BUCKETS",
    "N_PARAM_BUCKETS",
    "PREFILL_TOKEN_TIME_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "build_1_2_5_buckets",
]

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PREFILL_TOKEN_TIME_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS: tuple[float, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
N_PARAM_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class Histogram:
    """A Prometheus histogram's data: per-bucket counts (not cumulative), sum and count.

    An observation lands in the first bucket whose upper bound is >= the value (`le`);
    values above the last bound only count towards `+Inf`.
    """

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("Histogram bounds must be strictly increasing.")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def __repr__(self) -> str:
        return f"<Histogram count={self.count} sum={self.sum:.6g}>"

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """`(upper bound, observations <= bound)` pairs, ending with `(inf, count)`."""
        pairs: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            pairs.append((bound, running))
        return pairs
