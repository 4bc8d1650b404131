"""A fast reader of the Prometheus text exposition format, for the few families we need.

A model server's `/metrics` page is big and almost all noise to a router: vLLM's is ~59 KB
and ~600 lines, mostly histograms, HTTP-server and Python-process families, of which the
control plane needs about eight lines (waiting, running, KV use, cache config, LoRA info,
prefix-cache counters). prometheus-client's parser walks every line character by character
in Python and costs 6-10 ms per such page; at 200 pods scraped ten times a second that is
twelve to twenty cores. This reader takes ~0.1 ms (bench/scrape_cost.py: 80-95x less), by
splitting the work:

1. Select: one compiled regular expression per set of wanted families finds their lines in
   a single pass in C. `re` factors the families' common prefix (`vllm:`) out of the
   alternation and searches for the literal newline + prefix, so the other lines cost
   almost nothing. A line belongs to family `x` when its metric name is `x` or `x` plus
   one of `SUFFIXES` (a counter's `x_total` and `x_created`, a histogram's or summary's
   `x_bucket`, `x_sum`, `x_count`) followed by `{`, a blank or the end of the line. The
   test is on the name alone, not on `# TYPE` lines, so a family can also be asked for by
   a sample name (`vllm:prefix_cache_hits_total`), and a family's lines are found wherever
   they are on the page.
2. Parse only those lines, strictly: label values with the escapes `\\"`, `\\\\` and `\\n`,
   commas and braces inside quoted values, quoted (UTF-8) label names, a trailing comma,
   Go float notation with exponents, `NaN`, `+Inf`/`-Inf`, leading blanks, and an
   optional timestamp (checked, then dropped). A malformed line of a wanted family raises
   `MetricsParseError` naming its line number: a pod that serves garbage must not be read
   as an idle pod.
3. Bound the work: at most `MAX_SAMPLES` samples and `MAX_LABELS` labels (over all
   samples) of the wanted families are parsed per call; past either, `PageTooLargeError`.
   The page's size is capped before this (fetching.py), but a capped page could still be
   all wanted lines (37,000 in 1 MiB: ~130 ms of Python), one line of 160,000 labels
   (~220 ms) or one value of 500,000 escapes (~220 ms). With the caps, the possessive
   value pattern and the unescaping in C, no page at the 1 MiB cap takes more than tens
   of milliseconds (tests/metrics/test_hostile_pages.py tries the worst shapes found),
   against ~0.1 ms for vLLM's 59 KB. A real page has a few dozen wanted samples; vLLM's
   LoRA history (`vllm:lora_requests_info`: one series per set of adapters ever seen,
   three labels each) is the only family that grows, and 10,000 label sets fill ~1 MiB.

Lines of other families are never parsed, so garbage there goes unnoticed: that is the
point. Comment lines (`# HELP`, `# TYPE`) and blank lines are skipped the same way. Metric
names quoted inside the braces (Prometheus 3's UTF-8 syntax, `{"name", ...}`) are not
recognised; no model server writes them. Unknown escapes in label values (`\\q`) are kept
as written, as prometheus-client keeps them.

Pure: no I/O and no state beyond a cache of compiled patterns. The result matches
prometheus-client's parser sample for sample on the wanted families
(tests/metrics/test_exposition.py checks every simulated engine's page and generated pages).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from xds_server.errors import MetricsParseError, PageTooLargeError

__all__ = ["MAX_LABELS", "MAX_SAMPLES", "SUFFIXES", "Sample", "parse_samples"]

SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count")
"""Sample-name suffixes that belong to the family they extend (text format 0.0.4)."""

MAX_SAMPLES = 10_000
"""The most samples of the wanted families one call parses (see the module docstring)."""
MAX_LABELS = 40_000
"""The most labels, over all the samples, one call parses."""


class Sample(NamedTuple):
    """One sample line: its metric name as written (suffix included), its labels, its value."""

    name: str
    labels: Mapping[str, str]
    value: float


# A label: a name (legacy, or quoted), `=`, a quoted value, and an optional comma. The value
# pattern is the "unrolled loop" form, which `re` runs much faster than the alternation
# `(?:[^"\\]|\\.)*` on long values, and possessive (nothing in it is ever given back: a
# quote ends it, and only an escape consumes one), which is 7x faster again on a value that
# is all escapes.
_QUOTED = r'"([^"\\\n]*+(?:\\.[^"\\\n]*+)*+)"'
_LABEL = re.compile(
    r"[ \t]*(?:([a-zA-Z_][a-zA-Z0-9_]*)|" + _QUOTED + r")[ \t]*=[ \t]*" + _QUOTED + r"[ \t]*(,)?"
)
_CLOSE = re.compile(r"[ \t]*\}")
_NO_LABELS: Mapping[str, str] = MappingProxyType({})
# Label blocks already parsed (`_cached_labels`), by their text.
_LABEL_CACHE: dict[str, Mapping[str, str]] = {}
_LABEL_CACHE_SIZE = 4096
_SUFFIX_PATTERN = "(?:" + "|".join(SUFFIXES) + ")?"


def parse_samples(
    text: str,
    families: Iterable[str],
    *,
    max_samples: int = MAX_SAMPLES,
    max_labels: int = MAX_LABELS,
) -> list[Sample]:
    """The samples of `families` on the exposition page `text`, in page order.

    Raises `MetricsParseError` (with the 1-based line number) for a malformed line of a
    wanted family, and `PageTooLargeError` past `max_samples` samples or `max_labels`
    labels of them. A wanted family absent from the page is not an error here: the
    caller knows which families it requires.
    """
    wanted = frozenset(families)
    if not wanted:
        return []
    at_start, after_newline = _selector(wanted)
    samples: list[Sample] = []
    budget = _Budget(max_labels)
    first = at_start.match(text)
    if first is not None:
        samples.append(_parse_line(text, first.start(1), first.end(1), budget))
    for match in after_newline.finditer(text):
        if len(samples) >= max_samples:
            raise PageTooLargeError(
                f"more than {max_samples} samples of the families read "
                f"({', '.join(sorted(wanted))}): not read further",
                line=text.count("\n", 0, match.start(1)) + 1,
            )
        samples.append(_parse_line(text, match.start(1), match.end(1), budget))
    return samples


class _Budget:
    """The labels one call may still parse (mutable, for one call)."""

    __slots__ = ("labels", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.labels = limit


@functools.lru_cache(maxsize=256)
def _selector(families: frozenset[str]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """Patterns whose group 1 is the metric name of a line of `families`: one for the first
    line of the page, one for every line after a newline (which keeps the literal prefix
    that makes the search fast; `(?:^|\\n)` would lose it)."""
    ordered = sorted(families, key=lambda family: (-len(family), family))
    name = "(?:" + "|".join(re.escape(family) for family in ordered) + ")" + _SUFFIX_PATTERN
    line = r"[ \t]*(" + name + r")(?=[{ \t\n]|\Z)"
    return re.compile(line), re.compile("\n" + line)


def _unescape(value: str) -> str:
    """`\\\\` -> `\\`, `\\n` -> newline, `\\"` -> `"`, other escapes kept as written.

    Splitting at the backslash pairs first pairs them from the left, as reading the value
    from the left does; what is left between them holds no pair, so the other two escapes
    cannot overlap. All in C: a value of half a million escapes takes milliseconds.
    """
    return "\\".join(part.replace("\\n", "\n").replace('\\"', '"') for part in value.split("\\\\"))


def _error(text: str, start: int, problem: str) -> MetricsParseError:
    return MetricsParseError(problem, line=text.count("\n", 0, start) + 1)


def _parse_line(text: str, start: int, name_end: int, budget: _Budget) -> Sample:
    """The sample whose metric name spans `text[start:name_end]`."""
    end = text.find("\n", name_end)
    if end == -1:
        end = len(text)
    name = text[start:name_end]
    pos = name_end
    while pos < end and text[pos] in " \t":
        pos += 1
    labels: Mapping[str, str] = _NO_LABELS
    if pos < end and text[pos] == "{":
        labels, pos = _cached_labels(text, start, pos + 1, end, name, budget)
    fields = text[pos:end].split()
    if not fields:
        raise _error(text, start, f"{name}: no value")
    if len(fields) > 2:
        raise _error(text, start, f"{name}: unexpected text after the value: {fields[2]!r}")
    value = _number(text, start, name, fields[0], "value")
    if len(fields) == 2:
        _number(text, start, name, fields[1], "timestamp")
    return Sample(name, labels, value)


def _cached_labels(
    text: str, start: int, pos: int, end: int, name: str, budget: _Budget
) -> tuple[Mapping[str, str], int]:
    """`_parse_labels` of the label block at `pos`, remembered by its text: a pod's label
    sets are the same on every scrape (and across pods), so each is parsed once. The
    block runs to the line's last `}` (a value after it has none); a block seen before
    is the same labels whatever the line's value. Returns the labels (shared, read-only)
    and the position after the brace."""
    close = text.rfind("}", pos, end)
    block = text[pos:close] if close != -1 else None
    known = _LABEL_CACHE.get(block) if block is not None else None
    if known is not None:
        if len(known) > budget.labels:
            raise PageTooLargeError(
                f"more than {budget.limit} labels on the samples of the families read: "
                "not read further",
                line=text.count("\n", 0, start) + 1,
            )
        budget.labels -= len(known)
        return known, close + 1
    labels: dict[str, str] = {}
    after = _parse_labels(text, start, pos, end, name, labels, budget)
    if block is not None and after == close + 1:
        if len(_LABEL_CACHE) >= _LABEL_CACHE_SIZE:
            _LABEL_CACHE.clear()  # a page of ever-new label sets: bounded, not grown
        _LABEL_CACHE[block] = MappingProxyType(labels)
    return labels, after


def _parse_labels(
    text: str,
    start: int,
    pos: int,
    end: int,
    name: str,
    labels: dict[str, str],
    budget: _Budget,
) -> int:
    """Read `k="v", ...}` from `pos` into `labels`; return the position after the brace."""
    close = _CLOSE.match(text, pos, end)
    if close is not None:
        return close.end()
    while True:
        if budget.labels <= 0:
            raise PageTooLargeError(
                f"more than {budget.limit} labels on the samples of the families read: "
                "not read further",
                line=text.count("\n", 0, start) + 1,
            )
        budget.labels -= 1
        match = _LABEL.match(text, pos, end)
        if match is None:
            raise _error(
                text,
                start,
                f"{name}: malformed label at column {pos - start + 1}: "
                f"{text[pos : min(end, pos + 40)]!r}",
            )
        key, quoted_key, value, comma = match.groups()
        if key is None:
            key = _unescape(quoted_key) if "\\" in quoted_key else quoted_key
            if not key:
                raise _error(text, start, f"{name}: empty label name")
        if "\\" in value:
            value = _unescape(value)
        if key in labels:
            raise _error(text, start, f"{name}: duplicate label {key!r}")
        labels[key] = value
        pos = match.end()
        close = _CLOSE.match(text, pos, end)
        if close is not None:
            return close.end()
        if comma is None:
            raise _error(
                text,
                start,
                f"{name}: expected ',' or '}}' at column {pos - start + 1}: "
                f"{text[pos : min(end, pos + 40)]!r}",
            )


def _number(text: str, start: int, name: str, field: str, what: str) -> float:
    """A Go-style float. Python's `float` reads the same spellings (`1e+06`, `+Inf`, `NaN`)
    and also `1_000`, which Prometheus does not, hence the check."""
    try:
        if "_" in field:
            raise ValueError(field)
        return float(field)
    except ValueError:
        raise _error(text, start, f"{name}: {what} is not a number: {field!r}") from None
