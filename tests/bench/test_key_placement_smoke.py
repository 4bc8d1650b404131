"""bench.key_placement on a few pools: placing keys evens more pools than the hash does."""

from __future__ import annotations

from bench.key_placement import key_placement
from xds_server.tuning import Tuning


def test_placing_evens_more_pools_than_the_hash_and_moves_few_keys() -> None:
    result = key_placement(pods=4, trials=6, tuning=Tuning())
    assert result["within_tolerance_placed"] > result["within_tolerance_hash"]
    assert result["keys_moved_max"] <= result["keys"] / 2
    assert 0 < result["decision_ms_max"]
