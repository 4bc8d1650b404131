"""From scores to EDS weights: smoothing, the long-prompt and spill cut, the ladder.

Scores are smoothed (EWMA, `balancing.smoothing`), then multiplied by
`balancing.long_prompt_weight_factor` once per long prompt prefilling on the pod and once
more when it spills for load (not smoothed, not remembered: it applies while the pod
prefills or spills and not a moment longer). They are scaled so that the best pod gets
MAX_WEIGHT and quantized to a geometric ladder (`Tuning.weight_ladder`) so that near-equal
pods get exactly equal weights (Envoy then balances a uniform fleet by plain round robin)
and small noise does not turn into EDS pushes or swings between Envoys. A pool with
session affinity also gets ring weights, the capacity factor on the same ladder (cut only
for a pod that keeps spilling its keys: homes.py): consistent hashing sizes each pod's
share of the keys by its weight, and keys that moved with load would lose their cached
prefixes (envoy/clusters.py).
"""

from __future__ import annotations

import math

from xds_server.tuning import MAX_WEIGHT

__all__ = ["quantize", "smoothed"]


def quantize(weight: float, ladder: float) -> int:
    """The ladder step nearest `weight`: MAX_WEIGHT / ladder^k for a whole k, at least 1."""
    steps_down = round(math.log(MAX_WEIGHT / min(MAX_WEIGHT, max(weight, 1.0))) / math.log(ladder))
    return max(1, round(MAX_WEIGHT / ladder**steps_down))


def smoothed(raw: float, previous: float | None, smoothing: float) -> float:
    """`raw` moved towards from `previous` (none: `raw` itself) by `smoothing`."""
    return raw if previous is None else smoothing * raw + (1 - smoothing) * previous
