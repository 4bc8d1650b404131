"""A pod's serving capacity: what it claims, checked against its peers and its pace.

One rule for both places a KV capacity is judged: the scraper's check of each page as it
comes (sources/pod_metrics.CapacityCheck) and the policy's check of what was believed
before the peers had spoken (`unbelieved_capacities`), so that a pod scraped first cannot
win the pool on a claim its peers later contradict. A pod's KV capacity is believed only
within `balancing.max_capacity_ratio` of the median of its peers (the pool's other pods of
its hardware class), when there are `Tuning.min_capacity_peers` or more of them.

Capacity is also measured, not only believed (`relative_capacities`): a pod that claims
more than its peers' median and whose requests take longer than theirs (`slowness`, from
the Envoys' reports: verdicts.py) counts as that median while it is slow. The median is
of the peers whose claims vouch for its own (within `Tuning.capacity_vouch_ratio` of it),
when there are any: in a pool of two H100-like and two A10G-like pods, a busy H100 that
fell behind the other H100's pace for a while counted as an A10G, and with both H100s so
judged every pod weighed the same, the A10Gs took a quarter of the requests each and the
P99 TTFT went from 0.36 s to 2.7-3.1 s (scenario a, seeds 2-3).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from xds_server.config import BalancingConfig, EndpointConfig, PoolConfig
from xds_server.policy.signals import PodSignals, endpoint_id
from xds_server.tuning import Tuning

__all__ = [
    "beyond_peers",
    "capacity_peer_group",
    "median_without",
    "relative_capacities",
    "unbelieved_capacities",
]


def capacity_peer_group(
    pool: PoolConfig, endpoint: EndpointConfig, settings: BalancingConfig
) -> str | None:
    """The pods whose KV capacities `endpoint`'s is compared with: the pool's of its
    hardware class, named "pool/class" ("pool/" for none); None when its capacity is the
    class's configured one (`hardware_capacity`), so that its KV capacity is not used."""
    if endpoint.hardware is not None and endpoint.hardware in settings.hardware_capacity:
        return None
    return f"{pool.name}/{endpoint.hardware or ''}"


def median_without(ordered: Sequence[float], value: float | None) -> float:
    """The median of `ordered` (sorted, not empty once `value` is left out) with one
    occurrence of `value` left out (None, or a value not in it: nothing left out).
    Constant time, so that a pod's peers' median costs nothing per scrape."""
    skip = len(ordered)
    if value is not None:
        index = bisect.bisect_left(ordered, value)
        if index < len(ordered) and ordered[index] == value:
            skip = index
    count = len(ordered) - (skip < len(ordered))

    def at(i: int) -> float:
        return ordered[i if i < skip else i + 1]

    middle = count // 2
    return at(middle) if count % 2 else (at(middle - 1) + at(middle)) / 2


def beyond_peers(
    capacity: float, ordered: Sequence[float], own: float | None, *, ratio: float, min_peers: int
) -> float | None:
    """The peers' median when `capacity` is over `ratio` times it, else None (also with
    fewer than `min_peers` peers). `ordered`: the group's believed capacities, sorted,
    `own` among them when not None (the pod's own, left out of its peers)."""
    peers = len(ordered) - (own is not None)
    if peers < min_peers:
        return None
    median = median_without(ordered, own)
    return median if capacity > ratio * median else None


def unbelieved_capacities(
    pool: PoolConfig,
    fresh: Mapping[str, PodSignals],
    settings: BalancingConfig,
    *,
    min_peers: int,
) -> dict[str, float]:
    """Fresh pods whose KV capacity is beyond their peers' (`beyond_peers`), with the
    median they were compared with."""
    groups: dict[str, dict[str, float]] = {}
    for endpoint in pool.endpoints:
        key = endpoint_id(endpoint)
        s = fresh.get(key)
        group = capacity_peer_group(pool, endpoint, settings)
        if s is not None and s.kv_capacity_tokens and group is not None:
            groups.setdefault(group, {})[key] = float(s.kv_capacity_tokens)
    unbelieved: dict[str, float] = {}
    for members in groups.values():
        ordered = sorted(members.values())
        for key, capacity in members.items():
            median = beyond_peers(
                capacity, ordered, capacity, ratio=settings.max_capacity_ratio, min_peers=min_peers
            )
            if median is not None:
                unbelieved[key] = median
    return unbelieved


_DEFAULT_TUNING = Tuning()


def relative_capacities(
    endpoints: tuple[EndpointConfig, ...],
    signals: Mapping[str, PodSignals],
    settings: BalancingConfig,
    slowness: Mapping[str, int] = MappingProxyType({}),
    tuning: Tuning = _DEFAULT_TUNING,
) -> dict[str, float]:
    """Relative capacity per endpoint (the largest is 1); unknown ones count as the largest.
    `signals` are those of pods scraped, and believed (stale ones too: the ring weights
    must not move when a pod's metrics stop).

    A pod that claims a larger KV cache than the median of the pool's other claims, and
    whose requests take longer than its peers' (`slowness`), counts as that median while
    it has any slowness: the median of the claims that vouch for its own (within
    `capacity_vouch_ratio` of it) when there are any, else of all the others. A larger
    pod that serves at its peers' pace keeps its claim, and so does one whose claim its
    like confirm; a liar gets its peers' share, which is what it has shown it serves."""
    raw: dict[str, float | None] = {}
    for endpoint in endpoints:
        key = endpoint_id(endpoint)
        if endpoint.hardware is not None and endpoint.hardware in settings.hardware_capacity:
            raw[key] = settings.hardware_capacity[endpoint.hardware]
        elif (s := signals.get(key)) is not None and s.kv_capacity_tokens:
            raw[key] = float(s.kv_capacity_tokens)
        else:
            raw[key] = None
    claimed_by = {k: v for k, v in raw.items() if v is not None}
    for key, steps in slowness.items():
        claimed = claimed_by.get(key)
        if claimed is not None and steps > 0:
            others = [v for k, v in claimed_by.items() if k != key]
            raw[key] = _held_to_peers(claimed, others, tuning.capacity_vouch_ratio)
    known = [v for v in raw.values() if v is not None]
    top = max(known, default=1.0)
    return {key: 1.0 if value is None else value / top for key, value in raw.items()}


def _held_to_peers(claimed: float, others: Sequence[float], vouch_ratio: float) -> float:
    """A slow pod's claim, at most the median of the claims that vouch for it (within
    `vouch_ratio` of it), or of all `others` when none does (none at all: its own)."""
    if not others:
        return claimed
    vouching = [v for v in others if v * vouch_ratio >= claimed]
    return min(claimed, statistics.median(vouching or others))
