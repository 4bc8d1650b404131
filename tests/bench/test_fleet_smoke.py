"""The fleet benchmark (bench/fleet.py) at a size that runs in seconds: the real server, a
real Envoy and ADS clients in two child processes, SotW and Delta, with and without flow
control. Every client must get its config, every push must reach every client, and no
process may outlive the run. And how the stall figures are read off the server's
/metrics, from a page prometheus-client renders."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from bench.fleet import FleetResult, FleetSpec, run_fleet
from bench.fleet_probe import ServerReading, stall_bound

LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _children() -> set[int]:
    """PIDs of this process's living children (Linux /proc)."""
    me, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if int(ppid) == me and state != "Z":
            found.add(int(stat.parent.name))
    return found


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


@pytest.mark.slow
@pytest.mark.parametrize(("delta", "flow_control"), [(False, False), (True, True)])
async def test_small_fleet_is_served_and_every_push_arrives(
    delta: bool, flow_control: bool
) -> None:
    before = _children()
    spec = FleetSpec(
        pools=4,
        endpoints=40,
        clients=10,
        scraped_pods=4,
        flow_control=flow_control,
        delta=delta,
        changes=3,
        config_changes=1,
        idle_s=2.0,
        clients_per_process=5,
    )
    result: FleetResult = await run_fleet(spec)

    assert result.protocol == ("delta" if delta else "sotw")
    assert (result.clients_served, result.clients_disconnected) == (10, 0)
    assert (result.missed_pushes, result.incomplete_pushes) == (0, 0)
    assert (result.config_missed, result.config_incomplete) == (0, 0)
    assert "eds" in result.config_change_types
    assert result.nacks == 0
    assert result.envoy_in_step
    for figure in (
        result.connect_all_s,
        result.change_to_first_ack_p50_s,
        result.change_to_last_ack_p99_s,
        result.config_change_to_last_ack_p99_s,
        result.cpu_s_per_push,
        result.idle_cpu_cores,
        result.rss_mb,
        result.sotw_eds_bytes_per_push,
        result.scraped_pods_per_core,
        result.idle_scrapes_per_s,
        result.envoy_live_s,
    ):
        assert _positive(figure), result
    assert result.change_to_first_ack_p50_s is not None
    assert result.change_to_last_ack_p50_s is not None
    assert result.change_to_first_ack_p50_s <= result.change_to_last_ack_p50_s
    # A pod's change touches its own pool's assignment only (Delta sends just that one).
    assert result.eds_resources_per_push is not None
    assert 1.0 <= result.eds_resources_per_push <= (1.0 if delta else spec.pools)
    assert result.signal_age_p99_s is not None and 0 <= result.signal_age_p99_s < 2.0
    assert result.responses_by_type.keys() == {"cds", "eds", "lds", "rds", "rtds"}
    if result.loop_stall_max_s is not None:  # the server exports its loop lag
        assert 0 <= result.loop_stall_max_s < 10
        assert result.loop_stalls_over_50ms is not None and result.loop_stalls_over_50ms >= 0
    assert _children() <= before, "a process started by the run outlived it"


def test_stall_bound_is_the_highest_grown_bucket_capped_by_the_largest_lag() -> None:
    registry = CollectorRegistry()
    lag = Histogram("xds_event_loop_lag_seconds", "", buckets=LAG_BUCKETS, registry=registry)
    largest = Gauge("xds_event_loop_lag_max_seconds", "", registry=registry)

    def reading() -> ServerReading:
        return ServerReading.parse(generate_latest(registry).decode(), at=0.0, cpu_s=0.0)

    for value in (0.001, 0.002, 0.3):
        lag.observe(value)
    largest.set(0.3)
    start = reading()
    for value in (0.001, 0.07, 0.02):
        lag.observe(value)
    middle = reading()
    assert stall_bound(start, middle) == 0.1  # (0.05, 0.1] grew; the 0.3 came before
    assert middle.stalls_over(0.05) == 2
    lag.observe(12.0)
    largest.set(12.0)
    end = reading()
    assert stall_bound(middle, end) == 12.0  # +Inf grew: the gauge says how far
    assert stall_bound(end, end) == 0.0
    assert stall_bound(start, end) == 12.0


def test_stall_figures_are_none_without_the_lag_metrics() -> None:
    page = "xds_scrape_duration_seconds_count 7.0\n"
    reading = ServerReading.parse(page, at=0.0, cpu_s=1.0)
    assert reading.scrapes == 7.0
    assert stall_bound(reading, reading) is None
    assert reading.stalls_over(0.05) is None
    assert reading.lag_max_s is None
