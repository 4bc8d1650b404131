"""The factors of a pod's score, each a named function of its signals (docs/routing.md):

    score = capacity^c · queue^q · kv_cache^k · running^r · prefix_cache^p

with the exponents c, q, k, r, p from `balancing.scorers` (0 turns a factor off). Each
factor is 1 for a pod with room and falls as the pod fills:

- capacity: the pod's serving capacity relative to the pool's largest (capacity.py). The
  default exponent is 4, not 1: Envoy's weighted balancing is proportional, not argmax,
  so a much slower pod would still get a steady trickle of requests that each wait far
  longer than in a fast pod's queue; the 4th power keeps slow pods as standby.
- queue: 1 / (1 + requests waiting beyond `balancing.queue_slack`): a request that
  arrived during an engine step waits for the next one even on an idle pod.
- kv_cache: 1 up to `Tuning.kv_knee` of the KV cache, then falling linearly to
  `Tuning.kv_floor` at full: a pod about to preempt should get less.
- running: 1 / (1 + running / slots), slots the pod's share of `Tuning.reference_slots`.
- prefix_cache: `Tuning.prefix_cache_base` + the pod's prefix-cache hit rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from xds_server.config import BalancingConfig, ScorerWeights
from xds_server.policy.reasons import Reason, ReasonCode
from xds_server.policy.signals import PodSignals
from xds_server.tuning import Tuning

__all__ = [
    "FACTORS",
    "Factor",
    "score",
    "weight_cuts",
]


def capacity_factor(
    signals: PodSignals, capacity: float, settings: BalancingConfig, tuning: Tuning
) -> float:
    return capacity


def queue_factor(
    signals: PodSignals, capacity: float, settings: BalancingConfig, tuning: Tuning
) -> float:
    return 1 / (1 + max(0.0, signals.waiting - settings.queue_slack))


def kv_cache_factor(
    signals: PodSignals, capacity: float, settings: BalancingConfig, tuning: Tuning
) -> float:
    kv = signals.kv_usage
    if kv is None or kv <= tuning.kv_knee:
        return 1.0
    return max(tuning.kv_floor, (1 - kv) / (1 - tuning.kv_knee))


def running_factor(
    signals: PodSignals, capacity: float, settings: BalancingConfig, tuning: Tuning
) -> float:
    slots = max(1.0, capacity * tuning.reference_slots)
    return 1 / (1 + max(0.0, signals.running) / slots)


def prefix_cache_factor(
    signals: PodSignals, capacity: float, settings: BalancingConfig, tuning: Tuning
) -> float:
    hit_rate = signals.prefix_hit_rate or 0.0
    return tuning.prefix_cache_base + min(1.0, max(0.0, hit_rate))


Factor = Callable[[PodSignals, float, BalancingConfig, Tuning], float]

# Each factor with its scorer (the exponent's name in `balancing.scorers`) and the reason
# it gives when it cuts a weight, in the order they multiply.
FACTORS: tuple[tuple[str, Factor, ReasonCode], ...] = (
    ("capacity", capacity_factor, "weight_capacity"),
    ("queue", queue_factor, "weight_queue"),
    ("kv_cache", kv_cache_factor, "weight_kv_cache"),
    ("running", running_factor, "weight_running"),
    ("prefix_cache", prefix_cache_factor, "weight_prefix_cache"),
)


def _exponent(scorers: ScorerWeights, name: str) -> float:
    return float(getattr(scorers, name))


def score(signals: PodSignals, capacity: float, settings: BalancingConfig, tuning: Tuning) -> float:
    """The pod's raw score: the product of its factors, each to its scorer's exponent."""
    values = (
        (factor(signals, capacity, settings, tuning), _exponent(settings.scorers, name))
        for name, factor, _ in FACTORS
    )
    return float(math.prod(value**exponent for value, exponent in values if exponent))


def weight_cuts(
    signals: PodSignals, capacity: float, settings: BalancingConfig, tuning: Tuning
) -> list[Reason]:
    """The factors that took something off the pod's score, with their figures."""
    cuts = []
    for name, factor, code in FACTORS:
        exponent = _exponent(settings.scorers, name)
        value = factor(signals, capacity, settings, tuning)
        if exponent and value < 1.0:
            cuts.append(Reason(code, f"{name} factor {value:.3g} ^ {exponent:g}"))
    return cuts

