"""`xds-server check-config`, run as CI runs it: a process, its exit status and output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "config.yaml"
POOL = "  - name: llama\n    models: [llama-3.1-8b]\n"
# Aliases of aliases: 100 nodes, then 20 times each level's (a "billion laughs").
ALIAS_BOMB = "a0: &a0 [" + ", ".join(["x"] * 100) + "]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 20)}]\n" for i in range(1, 5)
)


def check(
    *args: str, stdin: bytes | None = None, **environ: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xds_server", "check-config", *args],
        input=None if stdin is None else stdin.decode(),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **environ},
    )


def written(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_example_is_valid() -> None:
    done = check(str(EXAMPLE))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{EXAMPLE}: valid (2 pool(s), 3 model(s) and adapter(s))"
    assert done.stderr == ""


def test_every_field_problem_is_named_by_its_path(tmp_path: Path) -> None:
    path = written(
        tmp_path,
        "listener: {port: 99999}\n"
        "pools:\n"
        f"{POOL}"
        "    endpont: []\n"
        "    endpoints:\n"
        "      - {address: 10.0.0.1, port: 8000}\n"
        "      - {address: not-an-ip, port: 8000}\n"
        "balancing: {scrape_interval_s: -1}\n",
    )
    done = check(path)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    paths = [line.removeprefix(f"{path}: ").split(":", 1)[0] for line in lines]
    assert sorted(paths) == [
        "balancing.scrape_interval_s",
        "listener.port",
        "pools.0.endpoints.1.address",
        "pools.0.endpont",
    ], lines
    assert all(line.startswith(f"{path}: ") for line in lines)


def test_more_than_twenty_problems_are_all_listed(tmp_path: Path) -> None:
    endpoints = "".join(f"      - {{address: bad-{i}, port: 8000}}\n" for i in range(25))
    path = written(tmp_path, f"pools:\n{POOL}    endpoints:\n{endpoints}")
    done = check(path)
    assert done.returncode == 1
    assert [line.split(": ")[1] for line in done.stderr.splitlines()] == [
        f"pools.0.endpoints.{i}.address" for i in range(25)
    ]


@pytest.mark.parametrize(
    ("document", "said"),
    [
        ("pools: [\n", "not valid YAML"),
        ("- a list\n", "expected a mapping at the top level, got list"),
        (f"pools:\n{POOL}{POOL}", "pool names used twice: llama"),
        (
            f"pools:\n{POOL}  - name: other\n    models: [llama-3.1-8b]\n",
            "model 'llama-3.1-8b' is served by both pool 'llama' and 'other'",
        ),
        ("x: " + "[" * 70 + "]" * 70 + "\n", "refused: nested deeper than 64 levels"),
        (ALIAS_BOMB, "refused: YAML aliases expand to more than 100000 nodes"),
    ],
)
def test_a_broken_document_is_refused_with_its_reason(
    tmp_path: Path, document: str, said: str
) -> None:
    done = check(written(tmp_path, document))
    assert done.returncode == 1
    assert said in done.stderr, done.stderr


def test_a_document_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    done = check(written(tmp_path, "#" * (1024 * 1024 + 1) + "\n"))
    assert done.returncode == 1
    assert "refused: 1048578 bytes, over the limit of 1048576 bytes" in done.stderr


def test_a_missing_file(tmp_path: Path) -> None:
    done = check(str(tmp_path / "absent.yaml"))
    assert done.returncode == 1
    assert f"{tmp_path / 'absent.yaml'}: cannot read: No such file or directory" in done.stderr


def test_standard_input() -> None:
    done = check("-", stdin=EXAMPLE.read_bytes())
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("<stdin>: valid")
    done = check("-", stdin=b"pools: []\n")
    assert done.returncode == 1
    assert done.stderr.startswith("<stdin>: pools: ")


def test_a_pool_without_endpoints_passes_with_a_warning(tmp_path: Path) -> None:
    done = check(written(tmp_path, f"pools:\n{POOL}    endpoints: []\n"))
    assert done.returncode == 0
    assert "warning: 1 pool(s) have no endpoints" in done.stderr
    assert "'llama'" in done.stderr


def test_a_selector_counts_only_on_kubernetes() -> None:
    k8s = str(ROOT / "k8s" / "server" / "config.yaml")
    done = check(k8s)
    assert done.returncode == 0
    assert "a selector is followed only with --kubernetes" in done.stderr
    for quiet in (check("--kubernetes", k8s), check(k8s, XDS_SERVER_KUBERNETES="true")):
        assert quiet.returncode == 0
        assert quiet.stderr == ""


def test_an_edit_that_empties_a_pool_is_refused_against_the_previous(tmp_path: Path) -> None:
    empty = f"pools:\n{POOL}    endpoints: []\n"
    previous = str(EXAMPLE)
    done = check("--previous", previous, written(tmp_path, empty))
    assert done.returncode == 1
    assert "would leave 1 pool(s) that listed endpoints with none: 'llama' (had 2)" in done.stderr
    allowed = f"pools:\n{POOL}    allow_empty: true\n    endpoints: []\n"
    done = check("--previous", previous, written(tmp_path, allowed, "allowed.yaml"))
    assert done.returncode == 0, done.stderr


def test_a_broken_previous_is_named(tmp_path: Path) -> None:
    broken = written(tmp_path, "pools: [\n", "previous.yaml")
    done = check("--previous", broken, str(EXAMPLE))
    assert done.returncode == 1
    assert done.stderr.startswith(f"{broken}: not valid YAML")
