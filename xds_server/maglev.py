"""Envoy's weighted Maglev table, computed here, so the server knows where a key goes.

The session clusters balance with Maglev over the endpoints' names (`use_hostname_for_hashing`,
clusters.py). Envoy 1.40 builds the table so (source/extensions/load_balancing_policies/
maglev/maglev_lb.cc): the hosts sorted by name; each an offset `xxHash64(name, 0) % size`
and a skip `xxHash64(name, 1) % (size - 1) + 1`; weights normalized to sum to 1; round
after round, a host whose `round * weight` has reached its target takes the next free slot
of `(offset + skip * next) % size` and adds the largest weight to its target (targets
start at 0). A request's session key takes slot `xxHash64(key, 0) % size` (one header hash
policy: its hash as is), unless the bounded load finds that host overloaded. Checked
against a real Envoy 1.40: 500 keys of 500 over four pods with unequal weights
(bench/results/homes-counted/maglev/).

`table_size` is the session cluster's table size, from a short ladder of primes (1,009,
4,099, 16,411, then Envoy's default 65,537) with at least a hundred slots a host: building
a table for a few pods takes half a millisecond and weights keep their precision (65,537
slots would take 0.3 s here). A pool that grows past a rung gets the next size, which
moves its keys once (a pod that joins moves a share of them anyway).

Small tables move more of the other pods' keys when a pod leaves: over 200 random pools of
three pods, 0.4% at the median with 1,009 slots and 0.02% with 65,537, and in one pool of
200 named as the tests name theirs, 29%. A pod leaves the session table only with
`balancing.spill_to: ring`, where spills move keys by taking the pod out; those clusters
keep Envoy's `RING_SPILL_TABLE_SIZE`, and their keys are not placed (policy/scoring.py).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

import xxhash

__all__ = ["MaglevTable", "RING_SPILL_TABLE_SIZE", "key_hash", "maglev_table", "table_size"]

# Table sizes (primes, as Envoy requires), smallest first, and the slots a host should have.
_TABLE_SIZES = (1009, 4099, 16411, 65537)
_SLOTS_PER_HOST = 100
# The session table with `spill_to: ring` (Envoy's default size).
RING_SPILL_TABLE_SIZE = 65537


def key_hash(value: str) -> int:
    """What Envoy's header hash policy hashes a session key to."""
    return int(xxhash.xxh64_intdigest(value.encode(), seed=0))


def table_size(hosts: int) -> int:
    """The session cluster's Maglev table size for `hosts` endpoints."""
    for size in _TABLE_SIZES:
        if size >= _SLOTS_PER_HOST * hosts:
            return size
    return _TABLE_SIZES[-1]


class MaglevTable:
    """One built table: `hosts` in Envoy's order, and each slot's host index."""

    def __init__(self, hosts: tuple[str, ...], slots: list[int]) -> None:
        self.hosts = hosts
        self._slots = slots

    def host_of(self, hashed: int) -> str:
        """The host a key with hash `hashed` goes to."""
        return self.hosts[self._slots[hashed % len(self._slots)]]

    def shares(self) -> dict[str, float]:
        """Each host's share of the slots."""
        counts = [0] * len(self.hosts)
        for index in self._slots:
            counts[index] += 1
        return {host: counts[i] / len(self._slots) for i, host in enumerate(self.hosts)}


def maglev_table(weights: Mapping[str, int], size: int) -> MaglevTable:
    """Envoy's table for hosts named as `weights`' keys with those endpoint weights."""
    hosts = tuple(sorted(h for h, w in weights.items() if w > 0))
    if not hosts:
        return MaglevTable((), [])
    total = sum(weights[h] for h in hosts)
    normalized = [weights[h] / total for h in hosts]
    largest = max(normalized)
    offset = [xxhash.xxh64_intdigest(h.encode(), seed=0) % size for h in hosts]
    skip = [xxhash.xxh64_intdigest(h.encode(), seed=1) % (size - 1) + 1 for h in hosts]
    following = [0] * len(hosts)
    target = [0.0] * len(hosts)
    slots = [-1] * size
    filled, turn = 0, 1
    while filled < size:
        for i, weight in enumerate(normalized):
            if filled >= size:
                break
            if turn * weight < target[i]:
                continue
            target[i] += largest
            slot = (offset[i] + skip[i] * following[i]) % size
            while slots[slot] != -1:
                following[i] += 1
                slot = (offset[i] + skip[i] * following[i]) % size
            slots[slot] = i
            following[i] += 1
            filled += 1
        turn += 1
    return MaglevTable(hosts, slots)
