"""The fast parser against prometheus-client's full parser, and its errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.utils import floatToGoString

from llm_sim.metrics_text import Flavour
from xds_server.errors import MetricsParseError, XdsServerError
from xds_server.metrics.exposition import Sample, parse_samples

from .pages import belongs, busy_engine, comparable, page, reference_samples

WANTED = {
    Flavour.VLLM: {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
        "vllm:prefix_cache_hits",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds",  # a histogram: _bucket, _sum, _count
    },
    Flavour.SGLANG: {
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_config_info",
        "sglang:cached_tokens",
        "sglang:prompt_tokens_total",
    },
    Flavour.TGI: {
        "tgi_queue_size",
        "tgi_batch_current_size",
        "tgi_batch_current_max_tokens",
        "tgi_request_count",  # a counter written without `_total`
        "tgi_request_duration",
    },
    Flavour.TRITON: {"nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics"},
    Flavour.TRTLLM_SERVE: {
        "trtllm_num_requests_waiting",
        "trtllm_num_requests_running",
        "trtllm_kv_cache_utilization",
        "trtllm_kv_cache_max_blocks",
        "trtllm_request_success",
    },
}


@pytest.mark.parametrize("flavour", list(Flavour), ids=lambda f: f.value)
def test_every_simulated_page_reads_as_the_full_parser_reads_it(flavour: Flavour) -> None:
    text = page(busy_engine(), flavour)
    wanted = frozenset(WANTED[flavour])
    fast = parse_samples(text, wanted)
    assert comparable(fast) == comparable(reference_samples(text, wanted))
    assert {belongs(s.name, wanted) for s in fast} == {True}
    # Every family of the page, too: nothing on it trips either parser differently.
    everything = frozenset(s.name for s in reference_samples(text))
    assert comparable(parse_samples(text, everything)) == comparable(reference_samples(text))


def test_the_selection_is_by_name_with_suffixes_only() -> None:
    text = (
        "# HELP x Docs that mention x 1 and x_total 2.\n"
        "# TYPE x counter\n"
        'x_total{a="1"} 3\n'
        'x_created{a="1"} 1.7e9\n'
        "x 4\n"
        "xy 5\n"
        "x_other 6\n"
        "x_total_bucket 7\n"
        'x_bucket{le="+Inf"} 8\n'
        "x_sum 9\n"
        "x_count 10\n"
        "# x 11\n"
    )
    got = [(s.name, s.value) for s in parse_samples(text, ["x"])]
    assert got == [
        ("x_total", 3),
        ("x_created", 1.7e9),
        ("x", 4),
        ("x_bucket", 8),
        ("x_sum", 9),
        ("x_count", 10),
    ]
    # A sample name works as a family name: exactly that name (and its own suffixes).
    assert [s.name for s in parse_samples(text, ["x_total"])] == ["x_total", "x_total_bucket"]
    assert parse_samples(text, []) == []
    assert parse_samples(text, ["absent"]) == []


def test_the_awkward_corners_of_the_format() -> None:
    text = (
        'm{path="a,b}{c=d",quote="say \\"hi\\"",back="c:\\\\dir",nl="1\\n2",odd="\\q"} 1\n'
        'm{a="1",} 2 1700000000000\n'
        "m{} 3\n"
        'm {a="x"}4\n'
        "  m 5\n"
        "\tm\t6\t\n"
        'm{"dotted.name"="v"} 7\n'
        'm{ a = "1" , b="2" } 8\r\n'
        "m NaN\n"
        "m +Inf\n"
        "m -Inf\n"
        "m 1.5e-07\n"
        "m -0\n"
        "m 12345678901234567890\n"
        "\n"
        "m0 1"  # not ours: a longer name
    )
    got = parse_samples(text, {"m"})
    assert [dict(s.labels) for s in got[:3]] == [
        {
            "path": "a,b}{c=d",
            "quote": 'say "hi"',
            "back": "c:\\dir",
            "nl": "1\n2",
            "odd": "\\q",
        },
        {"a": "1"},
        {},
    ]
    assert [s.value for s in got[:3]] == [1, 2, 3]
    assert got[3] == Sample("m", {"a": "x"}, 4)
    assert [s.value for s in got[4:6]] == [5, 6]
    assert got[6].labels == {"dotted.name": "v"}
    assert got[7] == Sample("m", {"a": "1", "b": "2"}, 8)
    assert math.isnan(got[8].value)
    assert [s.value for s in got[9:]] == [math.inf, -math.inf, 1.5e-07, 0.0, 1.2345678901234567e19]
    assert comparable(got) == comparable(reference_samples(text, frozenset({"m"})))


def test_the_first_and_the_last_line_count() -> None:
    assert parse_samples("a 1", ["a"]) == [Sample("a", {}, 1.0)]
    assert parse_samples("a 1\nb 2", ["b"]) == [Sample("b", {}, 2.0)]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('x{a="b"}', "no value"),
        ("x", "no value"),
        ("x   ", "no value"),
        ('x{a="b" 1', "expected ',' or '}' at column 9: '1'"),
        ("x{a=b} 1", "malformed label"),
        ('x{a="b\\"} 1', "malformed label"),
        ('x{,a="b"} 1', "malformed label"),
        ('x{a="b",,c="d"} 1', "malformed label"),
        ('x{a="b"c="d"} 1', "expected ','"),
        ('x{a="b",a="c"} 1', "duplicate label 'a'"),
        ('x{""="b"} 1', "empty label name"),
        ("x one", "value is not a number: 'one'"),
        ("x 1_000", "value is not a number"),
        ("x 1 2 3", "unexpected text after the value"),
        ("x 1 noon", "timestamp is not a number"),
        ("x_total{le=} 1", "malformed label"),
    ],
)
def test_a_malformed_wanted_line_is_an_error_naming_its_line(line: str, problem: str) -> None:
    text = f"# HELP x Fine.\n# TYPE x gauge\nx 1\n{line}\ny{{broken 1\n"
    with pytest.raises(MetricsParseError) as caught:
        parse_samples(text, {"x"})
    assert caught.value.line == 4
    assert problem in caught.value.problem
    assert str(caught.value).startswith("line 4: x")
    assert isinstance(caught.value, XdsServerError)


def test_garbage_in_other_families_is_not_looked_at() -> None:
    text = "y{broken 1\n\x00\x01garbage {{{\nx 2\nz one two three four\n"
    assert parse_samples(text, {"x"}) == [Sample("x", {}, 2.0)]


# -- generated pages ------------------------------------------------------------------------

_names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True)
# `le` is the histogram buckets' own label: a generated one would duplicate it.
_label_names = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,8}", fullmatch=True).filter(
    lambda name: name != "le"
)
_label_values = st.text(
    st.one_of(
        st.sampled_from(['"', "\\", "\n", ",", "}", "{", "=", " ", "\t", "#", "é", "\u2028"]),
        st.characters(blacklist_categories=("Cs",)),
    ),
    max_size=12,
)
_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**20), max_value=10**20).map(float),
)
_formats = st.sampled_from(["go", "repr", "g17", "exp"])


def _format(value: float, style: str) -> str:
    if math.isnan(value) or math.isinf(value) or style == "go":
        return floatToGoString(value)
    if style == "repr":
        return repr(value)
    if style == "g17":
        return f"{value:.17g}"
    return f"{value:.6e}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@st.composite
def _pages(draw: st.DrawFn) -> tuple[str, frozenset[str]]:
    names = draw(st.lists(_names, min_size=1, max_size=6, unique=True))
    lines: list[str] = []
    for name in names:
        kind = draw(st.sampled_from(["gauge", "counter", "counter_total", "histogram", "untyped"]))
        if draw(st.booleans()):
            lines.append(f"# HELP {name} Some \\\\ help \\n text with {name}_total in it.")
        if kind == "counter_total":
            lines.append(f"# TYPE {name}_total counter")
        elif kind != "untyped" or draw(st.booleans()):
            lines.append(f"# TYPE {name} {kind}")
        for _ in range(draw(st.integers(min_value=0, max_value=3))):
            keys = draw(st.lists(_label_names, max_size=3, unique=True))
            labels = ",".join(f'{k}="{_escape(draw(_label_values))}"' for k in keys)
            labels = "{" + labels + ("," if keys and draw(st.booleans()) else "") + "}"
            if not keys and draw(st.booleans()):
                labels = ""
            value = _format(draw(_values), draw(_formats))
            stamp = f" {draw(st.integers(0, 2**40))}" if draw(st.booleans()) else ""
            if kind == "histogram":
                for le in ("0.1", "1.0", "+Inf"):
                    inner = labels[1:-1].rstrip(",")
                    le_labels = "{" + (inner + "," if inner else "") + f'le="{le}"' + "}"
                    lines.append(f"{name}_bucket{le_labels} {value}")
                lines.append(f"{name}_sum{labels} {value}{stamp}")
                lines.append(f"{name}_count{labels} {value}")
            else:
                suffix = "_total" if kind == "counter_total" else ""
                lines.append(f"{name}{suffix}{labels} {value}{stamp}")
        if draw(st.booleans()):
            lines.append(draw(st.sampled_from(["", "# a comment", "#"])))
    wanted = draw(st.lists(st.sampled_from(names), unique=True))
    extra = draw(st.lists(_names, max_size=2))
    return "\n".join(lines) + "\n", frozenset(wanted + extra)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_pages())
def test_generated_pages_read_as_the_full_parser_reads_them(
    case: tuple[str, frozenset[str]],
) -> None:
    text, wanted = case
    assert comparable(parse_samples(text, wanted)) == comparable(reference_samples(text, wanted))
