"""The shape of the code a newcomer must change: small functions, no magic numbers.

- No function in xds_server/ above cyclomatic complexity 20 (radon): a rule with more
  branches than that is several rules, and should say so by name.
- The policy's numbers come from `Tuning` (xds_server/tuning.py): a bare numeric literal
  other than 0, 1 or 2 in xds_server/policy/ is a threshold without a name, a meaning or a
  benchmark behind it, which no operator can override.
- docs/tuning.md is what `python -m xds_server.tuning` prints.
"""

from __future__ import annotations

import ast
from pathlib import Path

from radon.complexity import cc_visit
from radon.visitors import Function

from xds_server.tuning import Tuning, reference_markdown

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "xds_server"
MAX_COMPLEXITY = 20
ALLOWED_LITERALS = {0, 1, 2}


def _complexities(path: Path) -> list[tuple[str, int]]:
    """Every function's and method's complexity (radon lists methods as functions too),
    nested functions included."""
    where = path.relative_to(ROOT)
    found = []
    for block in cc_visit(path.read_text()):
        if isinstance(block, Function):
            for function in (block, *block.closures):
                name = f"{where}:{function.lineno} {function.fullname}"
                found.append((name, function.complexity))
    return found


def test_no_function_of_the_server_is_more_complex_than_20() -> None:
    measured = [c for path in sorted(PACKAGE.rglob("*.py")) for c in _complexities(path)]
    assert len(measured) > 500  # the walk found the code
    too_complex = [(where, n) for where, n in measured if n > MAX_COMPLEXITY]
    assert not too_complex, too_complex


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of `tree` (their text is not code)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def bare_numbers(source: str) -> list[tuple[int, object]]:
    """Numeric literals of `source` other than 0, 1 and 2 (line, value)."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and id(node) not in skip
        and isinstance(node.value, int | float | complex)
        and not isinstance(node.value, bool)
        and node.value not in ALLOWED_LITERALS
    ]


def test_the_literal_check_finds_a_bare_threshold() -> None:
    assert bare_numbers("x = 2 * y\nif load > 0.8 * limit:\n    pass\n") == [(2, 0.8)]
    assert bare_numbers('"""Figures: 0.8 of 48."""\nx = -1\n') == []


def test_every_number_of_the_policy_comes_from_tuning() -> None:
    files = sorted((PACKAGE / "policy").glob("*.py"))
    assert len(files) > 10
    found = {
        str(path.relative_to(ROOT)): numbers
        for path in files
        if (numbers := bare_numbers(path.read_text()))
    }
    assert not found, found


def test_every_tuning_field_is_documented_with_a_unit_and_its_evidence() -> None:
    for name, field in Tuning.model_fields.items():
        extra = field.json_schema_extra
        assert isinstance(extra, dict), name
        assert field.description and extra.get("unit") and extra.get("evidence"), name


def test_the_tuning_reference_is_generated_from_the_code() -> None:
    assert (ROOT / "docs" / "tuning.md").read_text() == reference_markdown(), (
        "docs/tuning.md is stale: python -m xds_server.tuning > docs/tuning.md"
    )
