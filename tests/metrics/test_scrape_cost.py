"""bench/scrape_cost.py runs, and its synthetic page is the size of a real vLLM page."""

from __future__ import annotations

import json

import pytest

from bench.scrape_cost import main, simulator_page, synthetic_page
from xds_server.metrics.engines import engine_adapter


def test_the_synthetic_page_is_as_big_as_a_real_one_and_reads_the_same() -> None:
    base = simulator_page()
    padded = synthetic_page(base)
    assert 59_000 <= len(padded.encode()) <= 63_000
    assert 628 <= padded.count("\n") <= 640
    adapter = engine_adapter("vllm")
    assert adapter.parse(padded) == adapter.parse(base)


@pytest.mark.slow
def test_the_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--pods", "3", "--interval", "0.05", "--seconds", "0.3", "--json"]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    for kind in ("simulator", "synthetic"):
        page = results["pages"][kind]
        assert page["parse"]["full_over_fast"] > 10
        assert page["scrape"]["scrapes"] > 0 and page["scrape"]["cpu_ms_per_scrape"] > 0
    assert results["pages"]["synthetic"]["scrape_gzip"]["gzip"] is True
    assert len(results["interval_table"]) == 9
