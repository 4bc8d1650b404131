"""Latency and throughput figures from replay results: what the benchmark tables show.

Pure: results in, numbers out, so a report can be recomputed from saved results files.

Percentiles use the nearest-rank method: the p-th percentile of n sorted values is the
value at rank ceil(p/100 · n) (1-based). It always returns an observed latency, never an
interpolation between two requests, and for small samples the tail percentiles are simply
the slowest requests (with 50 requests, p99 is the maximum), which is the honest reading.

Latencies (TTFT, TPOT, end to end) are taken over successful requests only (a complete
200): a refused request has no first token. Refusals and errors are counted separately in
`status_counts`, so a policy that "wins" on latency by refusing more shows it there.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_sim.loadgen.results import OK_STATUS, ErrorKind, RequestResult

__all__ = ["Summary", "percentile", "summarize", "ttft_sample"]

_TOO_MANY_REQUESTS = 429


def percentile(values: Iterable[float], p: float) -> float | None:
    """The nearest-rank `p`-th percentile (0 < p ≤ 100) of `values`; None when empty."""
    return _nearest_rank(sorted(values), p)


def _nearest_rank(ordered: Sequence[float], p: float) -> float | None:
    if not 0 < p <= 100:
        raise ValueError(f"percentile {p} is outside (0, 100]")
    if not ordered:
        return None
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, kw_only=True)
class Summary:
    """The figures of one replay. Times in seconds; None where there was no sample.

    `status_counts` maps "200", "429", ... and "error:<kind>" (see `ErrorKind`) to counts.
    `output_tokens_per_s` is the successful requests' output tokens over `duration_s`.
    `refused_by_band` counts HTTP responses other than 200, per band; `retry_after_missing`
    counts 429s that came without a Retry-After header.

    Faults: `failed_before_headers` counts requests sent that never got response headers
    (refused or reset connections, timeouts before headers); `cut_streams` counts 200s whose
    body broke off before its end (`data: [DONE]`), `cut_streams_without_tokens` those of
    them that had not had a first token; `non_json_errors` counts responses other than 200
    whose body was not JSON.
    """

    requests: int
    successful: int
    duration_s: float
    status_counts: Mapping[str, int]
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p95_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    output_tokens_per_s: float
    ttft_p99_by_band_s: Mapping[str, float | None] = field(default_factory=dict)
    refused_by_band: Mapping[str, int] = field(default_factory=dict)
    retry_after_missing: int = 0
    failed_before_headers: int = 0
    cut_streams: int = 0
    cut_streams_without_tokens: int = 0
    non_json_errors: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "successful": self.successful,
            "duration_s": self.duration_s,
            "status_counts": dict(self.status_counts),
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p95_s": self.ttft_p95_s,
            "ttft_p99_s": self.ttft_p99_s,
            "tpot_p50_s": self.tpot_p50_s,
            "tpot_p95_s": self.tpot_p95_s,
            "e2e_p50_s": self.e2e_p50_s,
            "e2e_p99_s": self.e2e_p99_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_p99_by_band_s": dict(self.ttft_p99_by_band_s),
            "refused_by_band": dict(self.refused_by_band),
            "retry_after_missing": self.retry_after_missing,
            "failed_before_headers": self.failed_before_headers,
            "cut_streams": self.cut_streams,
            "cut_streams_without_tokens": self.cut_streams_without_tokens,
            "non_json_errors": self.non_json_errors,
        }


# Errors that end a request the client did send and wait on: a request cut off by them before
# its first token counts in the TTFT percentiles with the time it had waited.
_CUT_OFF = frozenset({ErrorKind.TIMEOUT, ErrorKind.RESET, ErrorKind.INCOMPLETE})
# A 200 whose body ended like this was cut by the server side (not by the client's deadline).
_BROKEN_OFF = frozenset({ErrorKind.RESET, ErrorKind.INCOMPLETE})


def ttft_sample(result: RequestResult) -> float | None:
    """The request's TTFT for the percentiles, or None when it does not count.

    Refused requests (an HTTP status other than 200) are counted apart, not here. A request
    cut off before its first token (timeout, reset) counts with the time it had waited, a
    lower bound: leaving it out would reward a policy for starving requests past the run's
    deadline.
    """
    if result.status is not None and result.status != OK_STATUS:
        return None
    if result.ttft_s is not None:
        return result.ttft_s
    if result.error in _CUT_OFF:
        return result.e2e_s
    return None


def summarize(results: Sequence[RequestResult], *, duration_s: float) -> Summary:
    """Summarize `results` from a run that lasted `duration_s` seconds of wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in results if r.ok]
    ttft = sorted(t for r in results if (t := ttft_sample(r)) is not None)
    tpot = sorted(r.tpot_s for r in ok if r.tpot_s is not None)
    e2e = sorted(r.e2e_s for r in ok if r.e2e_s is not None)
    bands = sorted({r.band for r in results})
    ttft_by_band: dict[str, list[float]] = {band: [] for band in bands}
    for r in results:
        if (sample := ttft_sample(r)) is not None:
            ttft_by_band[r.band].append(sample)
    refused = Counter(r.band for r in results if r.status is not None and r.status != OK_STATUS)
    cut = [r for r in results if r.status == OK_STATUS and r.error in _BROKEN_OFF]
    return Summary(
        requests=len(results),
        successful=len(ok),
        duration_s=duration_s,
        status_counts=dict(sorted(Counter(r.outcome for r in results).items())),
        ttft_p50_s=_nearest_rank(ttft, 50),
        ttft_p95_s=_nearest_rank(ttft, 95),
        ttft_p99_s=_nearest_rank(ttft, 99),
        tpot_p50_s=_nearest_rank(tpot, 50),
        tpot_p95_s=_nearest_rank(tpot, 95),
        e2e_p50_s=_nearest_rank(e2e, 50),
        e2e_p99_s=_nearest_rank(e2e, 99),
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration_s,
        ttft_p99_by_band_s={band: percentile(v, 99) for band, v in ttft_by_band.items()},
        refused_by_band={band: refused[band] for band in bands},
        retry_after_missing=sum(
            1 for r in results if r.status == _TOO_MANY_REQUESTS and r.retry_after is None
        ),
        failed_before_headers=sum(
            1 for r in results if r.status is None and r.error is not ErrorKind.DROPPED_BY_CLIENT
        ),
        cut_streams=len(cut),
        cut_streams_without_tokens=sum(1 for r in cut if r.ttft_s is None),
        non_json_errors=sum(1 for r in results if r.error_json is False),
    )
