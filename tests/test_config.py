"""The routing config: what is accepted, and how refusals name the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from xds_server.config import load_config, parse_config
from xds_server.errors import ConfigError

GOOD = """
listener: {address: 127.0.0.1, port: 8080}
pools:
  - name: llama
    models: [llama-3.1-8b, llama-3.1-8b-instruct]
    endpoints:
      - {address: 10.0.0.1, port: 8000, weight: 3}
      - {address: 10.0.0.2, port: 8000}
  - name: qwen
    models: [qwen3-32b]
"""


def test_good_config_with_defaults() -> None:
    config = parse_config(GOOD)
    assert [p.name for p in config.pools] == ["llama", "qwen"]
    assert config.pools[0].endpoints[1].weight == 1
    assert config.listener.max_request_bytes >= 8 * 1024 * 1024
    assert config.pool_of("qwen3-32b") is config.pools[1]
    assert config.pool_of("nope") is None


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("pools: []", "pools: Tuple should have at least 1 item"),
        ("pools: [{name: a, models: [m]}]\nlistner: {}", "listner: Extra inputs are not permitted"),
        ("pools: [{name: a, models: [m]}, {name: a, models: [n]}]", "pool names used twice: a"),
        (
            "pools: [{name: a, models: [m]}, {name: b, models: [m]}]",
            "served by both pool 'a' and 'b'",
        ),
        ("pools: [{name: a, models: [m, m]}]", "models listed twice: m"),
        ("pools: [{name: A_, models: [m]}]", "pools.0.name: String should match pattern"),
        (
            "pools: [{name: a, models: [m], endpoints: [{address: host, port: 1}]}]",
            "'host' is not an IP",
        ),
        (
            "pools: [{name: a, models: [m], endpoints: [{address: 10.0.0.1, port: 70000}]}]",
            "pools.0.endpoints.0.port",
        ),
        (
            "pools: [{name: a, models: [m], endpoints: "
            "[{address: 10.0.0.1, port: 1}, {address: 10.0.0.1, port: 1}]}]",
            "endpoint 10.0.0.1:1 listed twice",
        ),
        (
            "pools: [{name: a, models: [m], endpoints: [{address: 10.0.0.1, port: 1, weight: 0}]}]",
            "weight",
        ),
        ("- just a list", "expected a mapping at the top level"),
        ("pools: [{name: a, models: ['<missing>']}]", "'<missing>' is reserved"),
        ('pools: [{name: a, models: ["m\\n"]}]', "has control characters"),
        ("pools: [", "not valid YAML"),
        (
            "pools: [{name: a, models: [m], selector: {match_labels: {}, target_port: 80}}]",
            "match_labels: Dictionary should have at least 1 item",
        ),
        (
            "pools: [{name: a, models: [m], selector: {match_labels: {'a b': x}, "
            "target_port: 80}}]",
            "pools.0.selector.match_labels.a b.[key]",
        ),
        (
            "pools: [{name: a, models: [m]}]\n"
            "model_rewrites: [{model: x, targets: [{model: nope, weight: 1}]}]",
            "rewrite of 'x' targets models no pool serves: nope",
        ),
        (
            "pools: [{name: a, models: [m]}]\n"
            "model_rewrites: [{model: x, targets: [{model: m, weight: 0}]}]",
            "every target of 'x' has weight 0",
        ),
        (
            "pools: [{name: a, models: [m]}]\nmodel_rewrites: ["
            "{model: x, targets: [{model: m, weight: 1}]}, "
            "{model: x, targets: [{model: m, weight: 2}]}]",
            "models rewritten twice: x",
        ),
    ],
)
def test_bad_config_names_the_problem(document: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document, source="test.yaml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("test.yaml: ")


def test_load_config_reports_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_pod_selector_renders_a_sorted_label_selector() -> None:
    config = parse_config(
        "pools: [{name: a, models: [m], selector: "
        "{match_labels: {'xds-server.io/engine': vllm, app: llama}, target_port: 8000}}]"
    )
    selector = config.pools[0].selector
    assert selector is not None and selector.target_port == 8000
    assert selector.label_selector == "app=llama,xds-server.io/engine=vllm"
