"""The docs hold together: the README stays short, links every page of docs/, and no
relative link in the README, docs/ or the benchmark results' index points at nothing.

Anchors are checked as GitHub renders them: a heading's slug is its text, lower-cased,
without punctuation other than `-` and `_`, spaces made `-`, and `-1`, `-2`, ... added to
repeats.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

from xds_server.config import RoutingConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 400

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target ends at whitespace or the closing paren.
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _checked_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), ROOT / "bench" / "results" / "README.md"]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, numbered from 1."""
    lines = []
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before repeats are numbered)."""
    text = _INLINE_LINK_TEXT.sub(r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """Every link target in the file's prose, with its line (code spans and blocks skipped)."""
    found = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_CODE_SPAN.sub("", line)):
            found.append((number, match.group(1)))
    return found


def broken(path: Path, target: str) -> str | None:
    """Why a relative link does not resolve, or None; links with a scheme are not checked."""
    if _SCHEME.match(target) or target.startswith("//"):
        return None
    file_part, _, anchor = target.partition("#")
    resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
    if not resolved.exists():
        return f"no such file {file_part}"
    if anchor and resolved.is_file() and resolved.suffix == ".md":
        if unquote(anchor) not in anchors(resolved):
            return f"no heading #{anchor} in {resolved.name}"
    return None


def test_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; the rest goes in docs/."


def test_the_readmes_config_is_valid() -> None:
    """The config at a glance is one the server accepts."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert blocks, "README.md shows no config"
    for block in blocks:
        RoutingConfig.model_validate(yaml.safe_load(block))


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {
        (README.parent / unquote(target.partition("#")[0])).resolve()
        for _, target in links(README)
        if not _SCHEME.match(target)
    }
    pages = sorted(DOCS.rglob("*"))
    assert pages, "docs/ is empty"
    missing = [p.relative_to(ROOT) for p in pages if p.is_file() and p.resolve() not in linked]
    assert not missing, f"not linked from README.md: {missing}"


def test_every_benchmark_run_is_indexed() -> None:
    results = ROOT / "bench" / "results"
    index = results / "README.md"
    indexed = {
        (results / unquote(target.partition("#")[0])).resolve().relative_to(results).parts[0]
        for _, target in links(index)
        if not _SCHEME.match(target) and not target.startswith("../")
    }
    folders = {p.name for p in results.iterdir() if p.is_dir()}
    assert not folders - indexed, f"not in bench/results/README.md: {sorted(folders - indexed)}"


@pytest.mark.parametrize("path", _checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    problems = [
        f"{path.relative_to(ROOT)}:{line}: {target}: {why}"
        for line, target in links(path)
        if (why := broken(path, target)) is not None
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Two commands", "two-commands"),
        ("Gray failures: pods that look healthy", "gray-failures-pods-that-look-healthy"),
        ("Peers: a real per-request router", "peers-a-real-per-request-router"),
        ("The `spill_to` key", "the-spill_to-key"),
        (
            "Scenario a: mixed generations (2 H100-like + 2 A10G-like pods, at 65%)",
            "scenario-a-mixed-generations-2-h100-like--2-a10g-like-pods-at-65",
        ),
        ("[Linked](other.md) heading", "linked-heading"),
    ],
)
def test_slugs_are_githubs(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_the_check_finds_a_broken_link(tmp_path: Path) -> None:
    """The checks above would pass anything if they found no link or no breakage."""
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Here\n\n"
        "[ok](other.md#a-section) [ok](#here) [ok](https://example.com/x.md)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [bad local](#there)\n"
        "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n",
        encoding="utf-8",
    )
    assert len(links(page)) == 6
    problems = [target for _, target in links(page) if broken(page, target)]
    assert problems == ["missing.md", "other.md#nowhere", "#there"]
