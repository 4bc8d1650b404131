"""bench/collector.py: what exists is frozen for the block, and the collections in it counted."""

from __future__ import annotations

import gc

from bench.collector import collector_frozen


def test_a_replay_block_freezes_what_exists_and_counts_the_collections_in_it() -> None:
    callbacks = list(gc.callbacks)
    survivor = [object() for _ in range(1000)]
    with collector_frozen() as pauses:
        assert gc.get_freeze_count() >= len(survivor)
        assert pauses.count == 0
        gc.collect()
        gc.collect(0)
        assert pauses.count == 2
        assert 0 < pauses.longest_s <= pauses.total_s
    assert gc.get_freeze_count() == 0
    assert gc.callbacks == callbacks
    gc.collect()
    assert pauses.count == 2
    assert pauses.to_json()["count"] == 2
