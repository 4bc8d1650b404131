"""The block pool: reference counts, the prefix cache and vLLM's eviction order."""

from __future__ import annotations

import pytest

from llm_sim.kv_cache import BlockPool, block_hashes


def words(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{k}" for k in range(n)]


def test_block_hashes_chain_and_include_the_adapter() -> None:
    base = block_hashes(words(40), block_size=16, adapter=None)
    assert len(base) == 2  # the partial third block is never hashed
    assert block_hashes(words(32), block_size=16, adapter=None) == base
    assert block_hashes(words(32), block_size=16, adapter="a")[0] != base[0]
    # Same tokens behind a different first block: a different second hash.
    other = block_hashes(["x", *words(32)[1:]], block_size=16, adapter=None)
    assert other[0] != base[0] and other[1] != base[1]
    continued = block_hashes(words(32)[16:], block_size=16, adapter=None, parent=base[0])
    assert continued == base[1:]


def test_freed_blocks_stay_findable_until_handed_out_again() -> None:
    pool = BlockPool(4)
    hashes = block_hashes(words(32), block_size=16, adapter=None)
    blocks = pool.allocate(2)
    for block, h in zip(blocks, hashes, strict=True):
        pool.cache(block, h)
    assert (pool.num_used, pool.usage()) == (2, 0.5)
    pool.free(blocks)
    assert (pool.num_used, pool.num_cached_free) == (0, 2)
    assert pool.lookup(hashes) == blocks
    # Two empty blocks are handed out first; then the request's LAST block is evicted first.
    pool.allocate(2)
    assert pool.lookup(hashes) == blocks
    pool.allocate(1)
    assert pool.lookup(hashes) == blocks[:1]


def test_reusing_cached_blocks_counts_against_free_space() -> None:
    pool = BlockPool(3)
    hashes = block_hashes(words(32), block_size=16, adapter=None)
    blocks = pool.allocate(2)
    for block, h in zip(blocks, hashes, strict=True):
        pool.cache(block, h)
    pool.free(blocks)
    hits = pool.lookup(hashes)
    assert pool.can_allocate(1, hits)
    assert not pool.can_allocate(2, hits)
    pool.touch(hits)
    assert pool.num_used == 2
    pool.touch(hits)  # a second request sharing the prefix
    pool.free(hits)
    assert pool.num_used == 2
    with pytest.raises(RuntimeError, match="KV blocks"):
        pool.allocate(2)
