"""The simulated GPU's KV-cache blocks and the prefix cache that lives in the unused ones.

vLLM v1's block pool, reduced to what routing can observe: a fixed number of blocks, each
with a reference count; a free queue ordered by eviction priority; and a map from block
hash to block for full blocks whose contents are known. A block whose last user finishes
keeps its hash and stays findable until it is handed out again (that is the eviction), so
a later request with the same prefix reuses it without computing it.

Eviction order is vLLM's: freed blocks go to the tail of the free queue, and a request's
blocks are freed last-first, so the tail of a prompt (the least shared part) is evicted
before its head. Allocation takes from the head.

Pure: no I/O, no clock. Mutable state: `_ref`, `_hash`, `_free`, `_cached`, `_cached_free`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["BlockPool", "Token", "block_hashes"]

# A token: a word, or a token id when a client sends ids.
Token = str | int


def block_hashes(
    tokens: Sequence[Token], *, block_size: int, adapter: str | None, parent: int | None = None
) -> list[int]:
    """Hashes of the full blocks of `tokens`, each chained to the one before it.

    A block's hash covers its parent's hash, its tokens and the LoRA adapter (vLLM's
    "extra keys"), so equal blocks only match behind equal prefixes of the same adapter.
    Only complete blocks are hashed; a partial last block is never cached. `parent` is the
    hash of the block before `tokens[0]` when hashing continues an existing chain.
    """
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size]), adapter))
        hashes.append(parent)
    return hashes


class BlockPool:
    """`num_blocks` KV blocks, their reference counts and the prefix cache.

    A block is in use (reference count above zero), free with a hash (cached, reusable
    until evicted), or free and empty. `num_free` counts both kinds of free block, as vLLM's
    KV usage does: a cached block costs nothing to evict.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("A block pool needs at least one block.")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Free blocks, head first: the head is the next to be handed out (evicted).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        self._cached_free = 0  # free blocks that still hold a hash

    def __repr__(self) -> str:
        return (
            f"<BlockPool blocks={self.num_blocks} used={self.num_used} cached={len(self._cached)}>"
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks with a known hash, in use or not."""
        return len(self._cached)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self._cached_free

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's `kv_cache_usage_perc`)."""
        return self.num_used / self.num_blocks

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes` (stops at the first miss)."""
        found: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, new_blocks: int, hits: Sequence[int]) -> bool:
        """Whether `new_blocks` empty blocks can be handed out after reusing `hits`.

        Hits that are free today leave the free queue when reused, so they count against
        it too (vLLM's `num_evictable_computed_blocks`).
        """
        evictable_hits = sum(1 for block in hits if self._ref[block] == 0)
        return new_blocks + evictable_hits <= len(self._free)

    def touch(self, hits: Iterable[int]) -> None:
        """Take a reference on cached blocks a request reuses."""
        for block in hits:
            if self._ref[block] == 0:
                del self._free[block]
                self._cached_free -= 1  # a hit always holds a hash
            self._ref[block] += 1

    def allocate(self, count: int) -> list[int]:
        """Hand out `count` blocks from the head of the free queue, evicting their hashes.

        The caller checks `can_allocate` first; asking for more than is free raises.
        """
        if count > len(self._free):
            raise RuntimeError(f"Asked for {count} KV blocks with {len(self._free)} free.")
        blocks: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:
                del self._cached[old]
                self._hash[block] = None
                self._cached_free -= 1
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of a request's blocks, last block first."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
                if self._hash[block] is not None:
                    self._cached_free += 1

    def cache(self, block: int, block_hash: int) -> None:
        """Record that `block` now holds the full block `block_hash`.

        If another block already holds the same content, that one stays the cached copy
        and this block is simply not findable (vLLM does the same).
        """
        if self._hash[block] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            self._hash[block] = block_hash
