"""Envoy 1.40's weighted Maglev table, in Python, to check that the server can predict it.

What Envoy does (source/extensions/load_balancing_policies/maglev/maglev_lb.cc): the hosts
are sorted by their hash key (the hostname, with `use_hostname_for_hashing`, as the
session clusters set it); each gets an offset `xxHash64(key, 0) % size` and a skip
`xxHash64(key, 1) % (size - 1) + 1`; weights are normalized to sum to 1; in each round a
host whose `round * weight` has reached its target takes its next free slot of
`(offset + skip * next) % size` and adds the largest weight to its target. A request with
a header hash policy takes slot `xxHash64(header value, 0) % size` (one hash policy: its
hash unchanged), unless the bounded load (`hash_balance_factor`) finds the host overloaded.

Needs `pip install xxhash numpy` (not dependencies of the project: this is an experiment).
"""

from __future__ import annotations

import numpy as np
import xxhash

TABLE_SIZE = 65537


def key_hash(value: str, seed: int = 0) -> int:
    return int(xxhash.xxh64_intdigest(value.encode(), seed=seed))


def maglev_table(weights: dict[str, int], size: int = TABLE_SIZE) -> tuple[list[str], np.ndarray]:
    """The hosts in Envoy's order and, for each slot, the index of the host that owns it."""
    names = sorted(weights)
    total = sum(weights[n] for n in names)
    normalized = [weights[n] / total for n in names]
    largest = max(normalized)
    offset = [key_hash(n) % size for n in names]
    skip = [key_hash(n, seed=1) % (size - 1) + 1 for n in names]
    following = [0] * len(names)
    target = [0.0] * len(names)
    table = np.full(size, -1, dtype=np.int32)
    filled, turn = 0, 1
    while filled < size:
        for i, weight in enumerate(normalized):
            if filled >= size:
                break
            if turn * weight < target[i]:
                continue
            target[i] += largest
            slot = (offset[i] + skip[i] * following[i]) % size
            while table[slot] != -1:
                following[i] += 1
                slot = (offset[i] + skip[i] * following[i]) % size
            table[slot] = i
            following[i] += 1
            filled += 1
        turn += 1
    return names, table


def home(names: list[str], table: np.ndarray, session_key: str) -> str:
    """The host Envoy sends `session_key`'s requests to (no host overloaded)."""
    return names[int(table[key_hash(session_key) % len(table)])]
