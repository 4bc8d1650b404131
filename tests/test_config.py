"""The routing config: what is accepted, and how refusals name the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import (
    ParseLimits,
    load_config,
    load_document,
    load_yaml,
    parse_config,
    read_document,
)
from xds_server.errors import ConfigError
from xds_server.tuning import Tuning

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
            "pools: [{name: a, models: [m], endpoints: "
            "[{address: 10.0.0.1, port: 1, name: p}, {address: 10.0.0.2, port: 1, name: p}]}]",
            "endpoint name 'p' used twice",
        ),
        (
            "pools: [{name: a, models: [m], endpoints: "
            "[{address: 10.0.0.1, port: 1}, {address: 10.0.0.2, port: 1, name: '10.0.0.1:1'}]}]",
            "pools.0.endpoints.1.name: String should match pattern",
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
        ("pools: [{name: a, models: [m], advanced: {spill_ful: 0.9}}]", "spill_ful"),
        ("balancing: {advanced: {kv_knee: 1.5}}\npools: [{name: a, models: [m]}]", "kv_knee"),
        (
            "pools: [{name: a, models: [m], advanced: {spill_full: 0.5}}]",
            "spill thresholds out of order",
        ),
        (
            "balancing: {advanced: {spill_release: 0.7}}\n"
            "pools: [{name: a, models: [m], advanced: {spill_ahead_full: 0.68}}]",
            "spill thresholds out of order",
        ),
    ],
)
def test_bad_config_names_the_problem(document: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document, source="test.yaml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("test.yaml: ")


def test_a_pools_advanced_tuning_overrides_the_balancing_defaults_for_it_alone() -> None:
    config = parse_config(
        "balancing: {advanced: {spill_full: 0.9, kv_knee: 0.7}}\n"
        "pools: [{name: a, models: [m], advanced: {spill_full: 0.85}}, {name: b, models: [n]}]",
        source="test.yaml",
    )
    a, b = config.pools
    assert (config.tuning(a).spill_full, config.tuning(a).kv_knee) == (0.85, 0.7)
    assert (config.tuning(b).spill_full, config.tuning(b).kv_knee) == (0.9, 0.7)
    assert config.tuning(b).spill_release == Tuning().spill_release


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


# Limits small enough for quick tests; the defaults are checked once each below.
SMALL = ParseLimits(max_bytes=8192, max_aliases=20, max_alias_nodes=500, max_depth=8)


def laughs(levels: int, width: int, leaves: int = 1) -> str:
    """A "billion laughs": each anchor holds `width` aliases of the one before."""
    lines = [f"a0: &a0 [{', '.join(['lol'] * leaves)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_default_limits() -> None:
    limits = ParseLimits()
    assert limits.max_bytes == 1 << 20  # what a ConfigMap holds at most
    assert (limits.max_aliases, limits.max_alias_nodes, limits.max_depth) == (256, 100_000, 64)


def test_a_document_over_the_size_cap_is_refused_unparsed() -> None:
    good = "pools: [{name: a, models: [m]}]\n"
    padded = good + "#" * (SMALL.max_bytes - len(good))
    assert parse_config(padded, limits=SMALL).pools[0].name == "a"
    with pytest.raises(ConfigError) as caught:
        parse_config(padded + "#", source="c.yaml", limits=SMALL)
    assert str(caught.value) == "c.yaml: refused: 8193 bytes, over the limit of 8192 bytes"
    # Counted in UTF-8 bytes, not characters.
    with pytest.raises(ConfigError, match="refused: 8193 bytes"):
        parse_config(padded[:-1] + "é", limits=SMALL)
    # The default cap: 1 MiB. Not even a YAML error is looked for beyond it.
    with pytest.raises(ConfigError, match="over the limit of 1048576 bytes"):
        parse_config(b"[" * ((1 << 20) + 1))


def test_a_billion_laughs_is_refused_at_the_first_alias_over_the_limit() -> None:
    # 9 levels of 9: 9^8 lists of 9 once expanded, in 486 bytes. safe_load takes no time
    # over it (aliases share one object), but whatever reads the result walks every use.
    with pytest.raises(ConfigError) as caught:
        parse_config(laughs(9, 9, leaves=9), source="c.yaml")
    assert str(caught.value) == (
        "c.yaml: refused: YAML aliases expand to more than 100000 nodes (after 37 aliases)"
    )
    # Many cheap aliases: the count alone.
    document = "e: &e 1\nx: [" + ", ".join(["*e"] * 257) + "]\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(document, source="c.yaml")
    assert str(caught.value) == "c.yaml: refused: more than 256 YAML aliases"


def test_aliases_within_the_limits_still_work() -> None:
    config = parse_config(
        "pools:\n"
        "  - &a {name: a, models: [m], endpoints: &e [{address: 10.0.0.1, port: 80}]}\n"
        "  - {<<: *a, name: b, models: [n], endpoints: *e}\n"
    )
    assert [p.name for p in config.pools] == ["a", "b"]
    assert config.pools[1].endpoints == config.pools[0].endpoints


def test_a_json_document_reads_as_its_yaml_reading() -> None:
    """JSON (what tools generate) takes the fast loader; it must mean what YAML reads."""
    document = {
        "listener": {"port": 8080},
        "pools": [
            {
                "name": "p",
                "models": ["m"],
                "endpoints": [{"address": "10.0.0.1", "port": 8000, "weight": 2}],
            }
        ],
    }
    text = json.dumps(document, indent=2)
    assert load_document(text, source="c", limits=SMALL) == load_yaml(
        text, source="c", limits=SMALL
    )
    assert parse_config(text) == parse_config(yaml.safe_dump(document))
    # Not JSON after all (a flow mapping, NaN): the YAML loader reads it.
    assert load_document("{a: 1}", source="c", limits=SMALL) == {"a": 1}
    assert load_document('{"a": NaN}', source="c", limits=SMALL) == {"a": "NaN"}
    # Just as deep as allowed: read.
    assert load_document('{"x": ' + "[" * 7 + "]" * 7 + "}", source="c", limits=SMALL)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("a: &a [1, *a]", "refused: the alias *a is inside its own anchor (a cycle)"),
        ("a: &a {b: *a}", "refused: the alias *a is inside its own anchor (a cycle)"),
        ("x: " + "[" * 8 + "]" * 8, "refused: nested deeper than 8 levels"),
        ('{"x": ' + "[" * 8 + "]" * 8 + "}", "refused: nested deeper than 8 levels"),
        ("".join(" " * i + "-\n" for i in range(12)), "refused: nested deeper than 8 levels"),
        ("a: *nowhere", "not valid YAML: found undefined alias 'nowhere'"),
        ("a: &x 1\nb: &x 2", "not valid YAML: found duplicate anchor 'x'"),
        ("a: " + "1" * 5000, "not valid YAML: Exceeds the limit (4300 digits)"),
        ("!!python/object/apply:os.system [true]", "not valid YAML: could not determine"),
    ],
)
def test_hostile_yaml_is_refused_with_what_was_wrong(document: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document, source="c.yaml", limits=SMALL)
    assert str(caught.value).startswith(f"c.yaml: {message}")


@settings(max_examples=150, deadline=None)
@given(levels=st.integers(1, 8), width=st.integers(1, 8), leaves=st.integers(1, 5))
def test_alias_limits_are_counted_exactly(levels: int, width: int, leaves: int) -> None:
    """Refused at the first alias over either limit (in document order), else loaded."""
    expected = None
    aliases = added = 0
    size = 1 + leaves  # the nodes under a0: the list and its scalars
    for _ in range(1, levels):
        for _ in range(width):
            aliases += 1
            if aliases > SMALL.max_aliases:
                expected = f"more than {SMALL.max_aliases} YAML aliases"
                break
            added += size
            if added > SMALL.max_alias_nodes:
                expected = f"YAML aliases expand to more than 500 nodes (after {aliases} aliases)"
                break
        if expected:
            break
        size = 1 + width * size
    document = laughs(levels, width, leaves)
    if expected is None:
        assert load_yaml(document, source="c", limits=SMALL) == yaml.safe_load(document)
    else:
        with pytest.raises(ConfigError) as caught:
            load_yaml(document, source="c", limits=SMALL)
        assert str(caught.value) == f"c: refused: {expected}"


_SCALARS = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
_TREES = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(shared=_TREES, other=_TREES, uses=st.integers(1, 4))
def test_within_the_limits_documents_load_as_safe_load_reads_them(
    shared: Any, other: Any, uses: int
) -> None:
    # safe_dump writes an object used twice as an anchor and aliases.
    document = yaml.safe_dump({"uses": [shared] * uses, "other": other, "again": shared})
    assert load_yaml(document, source="c", limits=ParseLimits()) == yaml.safe_load(document)


def test_a_refusal_lists_the_first_20_problems() -> None:
    document = "pools: [" + ", ".join(["{name: A, models: [m]}"] * 50) + "]"
    with pytest.raises(ConfigError) as caught:
        parse_config(document)
    message = str(caught.value)
    assert message.count("pools.") == 20
    # 50 names; not `pools` too short as well (pydantic's count of the pools that passed).
    assert message.endswith("; and 30 more problems")
    problems = caught.value.problems
    assert len(problems) == 50
    assert problems[-1].startswith("pools.49.name: String should match pattern")


def test_a_file_over_the_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    with path.open("wb") as file:
        file.truncate(4 << 30)  # sparse: reading it would take seconds and 4 GiB
    with pytest.raises(ConfigError) as caught:
        read_document(path)
    assert str(caught.value) == f"{path}: refused: {4 << 30} bytes, over the limit of 1048576 bytes"
    path.write_text("pools: [{name: a, models: [m]}]")
    assert load_config(path, limits=SMALL).pools[0].name == "a"
