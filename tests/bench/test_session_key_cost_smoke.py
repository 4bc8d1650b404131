"""bench.session_key_cost at a small size: every entry counts, and the figures agree."""

from __future__ import annotations

import pytest

from bench.session_key_cost import session_key_cost, session_key_cost_over_grpc


def test_session_key_cost_counts_every_key_and_reports_a_rate() -> None:
    result = session_key_cost(pools=2, keys=8, entries=16, batches=20)
    # 256 batches of 16 entries over 2 x 8 keys: every key was seen and is held.
    assert result["keys_held"] == 16
    assert result["entries_timed"] == 20 * 16
    assert result["cpu_us_per_entry"] > 0
    assert result["entries_per_core_s"] == pytest.approx(1e6 / result["cpu_us_per_entry"])


def test_session_key_cost_over_grpc_counts_the_server_process_per_message() -> None:
    result = session_key_cost_over_grpc(pools=2, keys=8, entries=4, batches=18, streams=2)
    # 18 batches over 2 streams, 9 each, and their keys in the server's store.
    assert result["messages"] == 18
    assert result["entries"] == 18 * 4
    assert 0 < result["keys_held"] <= 16
    assert result["cpu_us_per_message"] == pytest.approx(4 * result["cpu_us_per_entry"])
    assert result["messages_per_core_s"] == pytest.approx(1e6 / result["cpu_us_per_message"])
