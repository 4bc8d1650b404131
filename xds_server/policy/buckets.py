"""Key homes as a table of buckets (`balancing.key_homes` "buckets"): a key homed at first sight.

Placing keys through the session cluster's Maglev ring weights (homes.py) moves slots of a
hash, never one key: a key is placed only after it has been seen, and each step that evens
the pods moves some keys seen once or twice, each a prefix miss on its next request. On
scenario c that left the project's pooled P99 at 430 ms against 214 for vllm-router's
sticky_least_loaded, which homes a key at its first request
(bench/results/bucket-homes/NOTES.md).

With buckets, Envoy reads a table the server writes. Each keyed request carries its
bucket, `xxHash64(key) % key_buckets` (envoy/_key_buckets.py); a bucket pinned to a pod
goes there, and a bucket pinned nowhere goes to the spares it is offered to, the pods new
keys go to (envoy/clusters.py, envoy/endpoints.py). Here:

- A bucket with a logged key and no pin is pinned to the pod in rotation its heaviest key
  was last served by (the Envoys log it, xds/session_keys.py): where its first request
  left the prefix. A key logged only through the spill listener, or only by a peer's
  Envoys, or last served by a pod now out, stays unpinned until a pod in rotation serves
  it: pinning it anywhere else would move it (on the benchmark, keys a fleet's earlier
  run had left went, all 32, to the one pod in rotation at the next run's first
  decision, for good).
- A pin stays while its pod is in the pool and the bucket has a logged key: no other
  key's arrival moves it. While its pod is out of rotation the bucket is not listed, so
  its keys go to a spare (as Maglev sends them to the other pods), and they come back
  with the pod. A pod that leaves the pool loses its pins.
- The spares are the pods whose pinned keys' load is at or under their share of the
  ring's capacity plus `Tuning.key_spare_slack` mean keys, those spilling aside (unless
  all are). A key's load is its recent requests plus `home_key_prior` times the mean
  key's, as in homes.py: in a key's first seconds its count is noise, while a key many
  times as busy as the others still weighs as several. Before any key, every pod is a
  spare. At the default slack (100 mean keys), every pod that does not spill is one: with
  slack 0, a pod ahead of its share took no new key, which often left one spare, and the
  new keys that arrived together queued on it (bench/results/bucket-homes/NOTES.md).
  Of those, only the pods that took the fewest first requests of keys lately
  (`balancing.new_key_prefill_s`, from the key log) stay spares: a key's first request
  on a pod prefills its whole prompt, and a new key sent there meanwhile queues behind
  that prefill; the pods' counts of requests in flight do not tell it from a decode.
- Every bucket not pinned to a pod in rotation goes to `Tuning.key_offer_width` spares
  (by default every one), and Envoy sends each of its requests to the one with the fewest
  in flight (least request, full scan: clusters.py) until its first is logged and the
  bucket pinned: new keys that arrive together spread over the spares as a router's
  would. With every spare the bucket is listed nowhere, and Envoy's default subset, the
  spares (`key_spare`), takes it; a narrower width offers it to the next spares on a ring
  of the spares (`Tuning.key_offer_points` points). A bucket pinned to a pod out of
  rotation is offered to the first of them only: its keys wait for their pod together.
  The ring depends on the spares only, so every replica offers alike, and a spare that
  comes or goes moves only the buckets of its arcs.

Pure: the memory of the last call comes in, the next goes out; no clock, no I/O. The work
is one pass over the pool's logged keys (at most `max_keys`, xds/session_keys.py).
"""

from __future__ import annotations

from bisect import bisect
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from functools import lru_cache

from xds_server.maglev import key_hash

__all__ = ["BucketHomes", "BucketMemory", "FollowedBuckets", "bucket_homes", "followed_buckets"]


@dataclass(frozen=True, kw_only=True)
class BucketMemory:
    """The buckets pinned, by bucket: the endpoint id of its pod."""

    pins: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class BucketHomes:
    memory: BucketMemory
    # Each pod's pinned buckets (pods with none absent), each spare's offered buckets (the
    # others), and the pods new keys go to.
    buckets: Mapping[str, tuple[int, ...]]
    offers: Mapping[str, tuple[int, ...]]
    spares: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class FollowedBuckets:
    """Another replica's table (peering/links.py): each pod's pinned buckets, and the pods
    its new keys go to."""

    buckets: Mapping[str, tuple[int, ...]]
    spares: frozenset[str]


def followed_buckets(
    known: Set[str],
    healthy: Sequence[str],
    followed: FollowedBuckets,
    *,
    buckets: int,
    offer_points: int,
    offer_width: int,
) -> BucketHomes:
    """The table of the replica this one follows, taken as it is (its pods in this pool
    only), so that every replica's Envoys send a key to the same pod; the spares, those
    of its spares in rotation here, else every pod in rotation; the offers, as that
    replica makes them from the same spares."""
    in_rotation = set(healthy)
    pins = {b: pod for pod, held in followed.buckets.items() if pod in known for b in held}
    spares = followed.spares & in_rotation or frozenset(in_rotation)
    listed = {p: held for p, held in followed.buckets.items() if p in in_rotation}
    return BucketHomes(
        memory=BucketMemory(pins=pins),
        buckets=listed,
        offers=_offers(
            listed,
            spares,
            len(in_rotation),
            parked={b for b, pod in pins.items() if pod not in in_rotation},
            buckets=buckets,
            points=offer_points,
            width=offer_width,
        ),
        spares=frozenset(spares),
    )


def bucket_homes(
    known: Set[str],
    healthy: Sequence[str],
    capacity_shares: Mapping[str, float],
    keys: Mapping[int, float] | None,
    served_by: Mapping[int, str] | None,
    spilling: Set[str],
    memory: BucketMemory,
    *,
    buckets: int,
    key_prior: float,
    offer_points: int,
    offer_width: int,
    spare_slack: float = 0.0,
    first_requests: Mapping[str, int] | None = None,
) -> BucketHomes:
    """The pool's pinned buckets, offers and spares after this decision.

    `known`: the pool's pods (endpoint ids); `healthy`: those in rotation;
    `capacity_shares`: each pod's ring weight from capacity (any scale); `keys`: each
    logged key hash's recent requests; `served_by`: the pod each key was last served by,
    where the Envoys said (endpoint ids);
    `spilling`: the pods spilling their keys now; `buckets`: `balancing.key_buckets`;
    `key_prior`: `Tuning.home_key_prior`; `offer_points`, `offer_width`:
    `Tuning.key_offer_points`, `Tuning.key_offer_width`; `spare_slack`:
    `Tuning.key_spare_slack`; `first_requests`: per pod, the keys whose first request on
    it was logged lately (`balancing.new_key_prefill_s`; None: none).
    """
    present = sorted(k for k in healthy if capacity_shares.get(k, 0.0) > 0)
    in_rotation = set(present)
    where = served_by or {}
    load: dict[int, float] = {}
    # Per bucket, its heaviest key served by a pod in rotation: (count, hash, pod).
    heaviest: dict[int, tuple[float, int, str]] = {}
    counts = keys or {}
    prior = key_prior * sum(counts.values()) / len(counts) if counts else 0.0
    for hashed, count in counts.items():
        bucket = hashed % buckets
        load[bucket] = load.get(bucket, 0.0) + count + prior
        pod = where.get(hashed)
        if pod in in_rotation:
            seen = (count, hashed, pod)
            heaviest[bucket] = max(heaviest.get(bucket, seen), seen)
    pins = {b: pod for b, pod in memory.pins.items() if pod in known and b in load}
    for bucket in sorted(heaviest.keys() - pins.keys()):
        pins[bucket] = heaviest[bucket][2]
    carried = dict.fromkeys(present, 0.0)
    by_pod: dict[str, list[int]] = {}
    for bucket, pod in sorted(pins.items()):
        if pod in in_rotation:
            carried[pod] += load[bucket]
            by_pod.setdefault(pod, []).append(bucket)
    listed = {pod: tuple(held) for pod, held in by_pod.items()}
    mean_key = sum(load.values()) / len(counts) if counts else 0.0
    spares = frozenset(
        _spares(
            present,
            capacity_shares,
            carried,
            spilling,
            spare_slack * mean_key,
            first_requests or {},
        )
    )
    return BucketHomes(
        memory=BucketMemory(pins=pins),
        buckets=listed,
        offers=_offers(
            listed,
            spares,
            len(present),
            parked={b for b, pod in pins.items() if pod not in in_rotation},
            buckets=buckets,
            points=offer_points,
            width=offer_width,
        ),
        spares=spares,
    )


def _offers(
    listed: Mapping[str, tuple[int, ...]],
    spares: Set[str],
    in_rotation: int,
    *,
    parked: Set[int],
    buckets: int,
    points: int,
    width: int,
) -> dict[str, tuple[int, ...]]:
    """Each spare's share of the buckets no pod in rotation holds: the `width` spares
    whose points on the ring follow the bucket's, but only the first of them for a
    `parked` bucket (pinned to a pod out of rotation): its keys have homes and a prefix
    cache to come back to, and wait on one pod, where least request over several would
    send each of their requests elsewhere. When `width` covers every spare, the other
    buckets are listed nowhere: Envoy's default subset is the spares (`key_spare`), so
    they go there alike, and a pool of hundreds of pods does not list every bucket on
    each. Each spare has `points` shared by the `in_rotation` pods (at least one), so a
    spare that comes or goes moves only its own arcs."""
    if not spares:
        return {}
    held = {b for pinned in listed.values() for b in pinned}
    every_spare = width >= len(spares)
    each = max(1, points // max(1, in_rotation))
    positions, owners = _spare_ring(tuple(sorted(spares)), each)
    offered: dict[str, list[int]] = {}
    for bucket, position in enumerate(_bucket_positions(buckets)):
        if bucket in held or (every_spare and bucket not in parked):
            continue
        wanted = 1 if bucket in parked else width
        at = bisect(positions, position)
        chosen: list[str] = []
        while len(chosen) < wanted:
            pod = owners[at % len(owners)]
            if pod not in chosen:
                chosen.append(pod)
                offered.setdefault(pod, []).append(bucket)
            at += 1
    return {pod: tuple(bs) for pod, bs in offered.items()}


@lru_cache
def _spare_ring(spares: tuple[str, ...], each: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ring of `spares`, `each` points a spare, sorted; and each point's pod."""
    ring = sorted((key_hash(f"{pod}#{i}"), pod) for pod in spares for i in range(each))
    return tuple(at for at, _ in ring), tuple(pod for _, pod in ring)


@lru_cache
def _bucket_positions(buckets: int) -> tuple[int, ...]:
    """Each bucket's point on the rings of spares."""
    return tuple(key_hash(f"key-bucket-{bucket}") for bucket in range(buckets))


def _spares(
    present: Sequence[str],
    capacity_shares: Mapping[str, float],
    carried: Mapping[str, float],
    spilling: Set[str],
    allowance: float,
    first_requests: Mapping[str, int],
) -> list[str]:
    """The pods at or under their capacity share of the pinned keys' load plus
    `allowance`, the spilling ones aside unless every such pod spills; every pod before
    any key (none when none is in rotation). Of those, the ones with the fewest
    `first_requests`: a key's first request on a pod prefills its whole prompt, and a new
    key sent to that pod meanwhile waits for it."""
    total = sum(carried.values())
    capacity = sum(capacity_shares[k] for k in present)
    under = [
        k
        for k in present
        if total <= 0 or carried[k] <= total * capacity_shares[k] / capacity + allowance
    ]
    calm = [k for k in under if k not in spilling] or under
    fewest = min((first_requests.get(k, 0) for k in calm), default=0)
    return [k for k in calm if first_requests.get(k, 0) == fewest]
