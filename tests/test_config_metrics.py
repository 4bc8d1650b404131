"""The routing config's metric-name and capacity-unit overrides (`pools[].metrics`,
`engine_metrics`): validated with the path of a wrong key, merged engine then pool, and
turned into each scrape target's reader."""

from __future__ import annotations

import pytest

from xds_server.config import MetricNamesConfig, parse_config
from xds_server.errors import ConfigError
from xds_server.metrics.engines import LogicalMetric, MetricName
from xds_server.sources.pod_metrics import scrape_targets

POOL = (
    "pools:\n- name: p\n  models: [m]\n  engine: trtllm\n"
    "  endpoints:\n  - {address: 10.0.0.1, port: 8000}\n"
    "  - {address: 10.0.0.2, port: 8000, engine: vllm}\n"
)


def test_every_logical_metric_can_be_named_in_the_config() -> None:
    assert set(MetricNamesConfig.model_fields) == {m.value for m in LogicalMetric}


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (
            "  metrics: {names: {waitng: x}}\n",
            "pools.0.metrics.names.waitng: Extra inputs are not permitted",
        ),
        ("  metrics: {names: {waiting: []}}\n", "waiting is required"),
        ("  metrics: {names: {running: 'not a name'}}\n", "pools.0.metrics.names.running"),
        ("  metrics: {capacity_unit: pages}\n", "pools.0.metrics.capacity_unit"),
        ("  metrics: {tokens_per_block: 0}\n", "pools.0.metrics.tokens_per_block"),
        ("  metrics: {kv_unit: blocks}\n", "pools.0.metrics.kv_unit: Extra inputs"),
        ("engine_metrics: {llamacpp: {}}\n", "engine_metrics.llamacpp"),
    ],
)
def test_a_wrong_override_is_refused_with_its_path(extra: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.")):
        parse_config(POOL + extra)


def test_engine_then_pool_overrides_reach_each_target() -> None:
    config = parse_config(
        POOL
        + "  metrics:\n"
        + "    names:\n"
        + "      waiting: trtllm_num_queued_requests\n"
        + "      kv_usage: []\n"
        + "      running: [trtllm_num_active_requests, trtllm_num_requests_running]\n"
        + "engine_metrics:\n"
        + "  trtllm:\n"
        + "    names: {waiting: ignored_by_the_pool, kv_capacity: {name: kv, labels: {t: max}}}\n"
        + "    capacity_unit: blocks\n"
        + "    tokens_per_block: 32\n"
        + "  vllm:\n"
        + "    names: {waiting: 'vllm:num_requests_waiting_v2'}\n"
    )
    targets = scrape_targets(config)
    trtllm = targets["10.0.0.1:8000"].adapter
    assert trtllm.names[LogicalMetric.WAITING] == (MetricName("trtllm_num_queued_requests"),)
    assert trtllm.names[LogicalMetric.RUNNING] == (
        MetricName("trtllm_num_active_requests"),
        MetricName("trtllm_num_requests_running"),
    )
    assert LogicalMetric.KV_USAGE not in trtllm.names  # [] : not read
    assert trtllm.names[LogicalMetric.KV_CAPACITY] == (MetricName("kv", {"t": "max"}),)
    assert (trtllm.capacity_unit, trtllm.tokens_per_block) == ("blocks", 32)
    # The vLLM endpoint of the trtllm pool: its engine's overrides, not the pool's.
    vllm = targets["10.0.0.2:8000"].adapter
    assert vllm.names[LogicalMetric.WAITING] == (MetricName("vllm:num_requests_waiting_v2"),)
    assert vllm.names[LogicalMetric.RUNNING] == (MetricName("vllm:num_requests_running"),)
    assert (vllm.capacity_unit, vllm.tokens_per_block) == ("tokens", None)
    page = (
        "trtllm_num_queued_requests 4\ntrtllm_num_requests_running 2\n"
        'trtllm_kv_cache_utilization 0.5\nkv{t="max"} 100\nkv{t="free"} 40\n'
    )
    metrics = trtllm.parse(page)
    assert (metrics.waiting, metrics.running, metrics.kv_usage) == (4, 2, None)
    assert metrics.kv_capacity_tokens == 3200


def test_trtllm_serve_is_scraped_on_its_prometheus_page() -> None:
    # trtllm-serve's /metrics is JSON (iteration stats); its Prometheus page is elsewhere.
    targets = scrape_targets(parse_config(POOL))
    assert targets["10.0.0.1:8000"].url == "http://10.0.0.1:8000/prometheus/metrics"
    assert targets["10.0.0.2:8000"].url == "http://10.0.0.2:8000/metrics"
    explicit = scrape_targets(parse_config(POOL + "  metrics_path: /custom\n"))
    assert {t.url for t in explicit.values()} == {
        "http://10.0.0.1:8000/custom",
        "http://10.0.0.2:8000/custom",
    }
