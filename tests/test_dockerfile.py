"""The Dockerfile keeps the properties that matter, checked without a Docker engine.

No engine runs here or in CI, so the image is never built by the tests. What can go wrong
without anyone noticing is checked on the text instead: the base image floats (``latest``,
``python:3.11``), the server runs as root, the entrypoint stops being the console script,
the image installs something other than this repository, a build tool creeps into the
final stage, or ``.dockerignore`` drops a file the build copies (which only fails at
``docker build`` time).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest

from xds_server.cli.parser import build_parser as _parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
# An exact release, e.g. 3.11.15 or 3.11.15-slim-bookworm: three numbers, then a variant.
_EXACT_TAG = re.compile(r"^\d+\.\d+\.\d+(-[a-z0-9][a-z0-9.-]*)?$")
_BUILD_TOOLS = ("build-essential", "gcc", "g++", "clang", "make", "cmake", "cargo", "rustc")


class Instruction(NamedTuple):
    keyword: str
    args: str


class Stage(NamedTuple):
    image: str
    name: str | None
    instructions: list[Instruction]


def parse_dockerfile(text: str) -> list[Stage]:
    """Split ``text`` into stages of instructions, joining ``\\`` continuations.

    Comment lines are dropped, also inside a continued instruction, as Docker does.
    """
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    if current:
        logical.append(current)

    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = " ".join(args.split())
        if keyword == "FROM":
            words = [word for word in args.split() if not word.startswith("--platform")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image=words[0], name=name, instructions=[]))
        else:
            assert stages, f"{keyword} comes before the first FROM."
            stages[-1].instructions.append(Instruction(keyword, args))
    return stages


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves ``path`` (relative, ``/``-separated) out of the build context.

    As Docker's pattern matcher: the last pattern that matches the path or one of its parent
    directories decides, ``!`` re-includes, ``*`` stays within one path segment and ``**``
    spans any number of them.
    """
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip().strip("/")
        regex = ""
        i = 0
        while i < len(glob):
            if glob.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif glob.startswith("**", i):
                regex += ".*"
                i += 2
            elif glob[i] == "*":
                regex += "[^/]*"
                i += 1
            elif glob[i] == "?":
                regex += "[^/]"
                i += 1
            elif glob[i] == "[":
                end = glob.index("]", i)
                regex += glob[i : end + 1]
                i = end + 1
            else:
                regex += re.escape(glob[i])
                i += 1
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def _dockerignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _exec_form(args: str) -> list[str]:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        value = None
    assert isinstance(value, list), f"{args} is not the JSON exec form."
    return [str(item) for item in value]


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final(stages: list[Stage]) -> Stage:
    return stages[-1]


def _runs(stage: Stage) -> list[str]:
    return [instruction.args for instruction in stage.instructions if instruction.keyword == "RUN"]


def _last(stage: Stage, keyword: str) -> str:
    found = [
        instruction.args for instruction in stage.instructions if instruction.keyword == keyword
    ]
    assert found, f"The stage FROM {stage.image} has no {keyword}."
    return found[-1]


def test_multi_stage_with_a_builder(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    assert stages[0].name == "builder"


def test_base_images_are_pinned(stages: list[Stage]) -> None:
    names = {stage.name for stage in stages if stage.name}
    for stage in stages:
        if stage.image in names:
            continue  # Built on an earlier stage, which is checked itself.
        assert "latest" not in stage.image, f"FROM {stage.image} floats."
        reference = _DIGEST.sub("", stage.image)
        _, _, tag = reference.rpartition(":")
        assert _DIGEST.search(stage.image) or _EXACT_TAG.match(tag), (
            f"FROM {stage.image} is pinned to neither a digest nor an exact version."
        )


def test_final_stage_runs_as_a_numeric_non_root_user(final: Stage) -> None:
    user, _, group = _last(final, "USER").partition(":")
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
    assert user.isdigit(), f"USER {user} is not a numeric uid."
    assert int(user) != 0, "The final stage runs as root."
    assert not group or (group.isdigit() and int(group) != 0)


def test_entrypoint_is_the_console_script(final: Stage) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "xds-server" in scripts
    assert _exec_form(_last(final, "ENTRYPOINT")) == ["xds-server"]
    assert _exec_form(_last(final, "CMD"))[:3] == ["run", "--config", "/etc/xds-server/config.yaml"]


def test_command_serves_the_exposed_ports_on_all_interfaces(final: Stage) -> None:
    # The CLI parses the CMD as it would at start-up, so a renamed flag fails here.
    args = _parser().parse_args(_exec_form(_last(final, "CMD")))
    exposed = {
        int(port.split("/")[0])
        for instruction in final.instructions
        if instruction.keyword == "EXPOSE"
        for port in instruction.args.split()
    }
    assert exposed == {18000, 9000}
    assert {args.xds_port, args.admin_port} == exposed
    # Loopback would be unreachable from outside the container.
    assert args.xds_address in ("0.0.0.0", "::")
    assert args.admin_address in ("0.0.0.0", "::")


def test_python_environment(final: Stage) -> None:
    env = " ".join(i.args for i in final.instructions if i.keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "PYTHONUNBUFFERED=1" in env


def test_builder_makes_a_wheel_of_this_repository(stages: list[Stage]) -> None:
    builder = stages[0]
    assert any(
        "pip wheel" in run and {"--no-deps", "."} <= set(shlex.split(run)) for run in _runs(builder)
    ), "The builder does not run pip wheel --no-deps on the repository."
    copied = {
        source
        for instruction in builder.instructions
        if instruction.keyword == "COPY" and "--from" not in instruction.args
        for source in shlex.split(instruction.args)[:-1]
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "pyproject.toml" in copied
    assert any(source.rstrip("/") == "xds_server" for source in copied)
    # setuptools reads the readme while building, so the wheel needs it in the context.
    if isinstance(project.get("readme"), str):
        readme = project["readme"]
        assert any(fnmatch.fnmatchcase(readme, source) for source in copied), (
            f"The builder does not copy {readme}."
        )
    # setuptools fails the build when a license file is missing.
    for license_file in project.get("license-files", []):
        assert any(fnmatch.fnmatchcase(license_file, source) for source in copied), (
            f"The builder does not copy {license_file}."
        )


def test_final_stage_installs_the_builders_wheel(final: Stage) -> None:
    installs = [run for run in _runs(final) if "pip install" in run]
    assert installs, "The final stage installs nothing."
    for run in installs:
        assert "from=builder" in run, f"RUN {run} does not take the wheel from the builder."
        assert re.search(r"xds_server-\S*\.whl", run), f"RUN {run} installs no xds_server wheel."


def test_final_stage_has_no_build_tools(final: Stage) -> None:
    for run in _runs(final):
        words = set(shlex.split(run.replace("&&", " ")))
        assert not words & set(_BUILD_TOOLS), f"RUN {run} brings a build tool."


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = _dockerignore_patterns()
    for path in (".git/HEAD", ".venv/bin/python", "tests/test_dockerfile.py", "bench/x.py"):
        assert dockerignore_excludes(patterns, path), f"{path} would be sent to the builder."
    for path in ("xds_server/__pycache__/config.cpython-311.pyc", "xds_server.egg-info/PKG-INFO"):
        assert dockerignore_excludes(patterns, path), f"{path} would be sent to the builder."


def test_dockerignore_keeps_what_the_builder_copies(stages: list[Stage]) -> None:
    patterns = _dockerignore_patterns()
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("readme")
    for instruction in stages[0].instructions:
        if instruction.keyword != "COPY" or "--from" in instruction.args:
            continue
        for source in shlex.split(instruction.args)[:-1]:
            path = source.rstrip("/")
            if any(char in path for char in "*?["):
                # A glob: check the file it is there to copy.
                if not (isinstance(readme, str) and fnmatch.fnmatchcase(readme, path)):
                    continue
                path = readme
            probe = f"{path}/__init__.py" if source.endswith("/") else path
            assert not dockerignore_excludes(patterns, probe), (
                f"COPY {source} would fail: .dockerignore leaves it out."
            )


@pytest.mark.parametrize(
    ("patterns", "path", "excluded"),
    [
        (["*", "!pkg/"], "pkg/mod.py", False),
        (["*", "!pkg/"], "other/mod.py", True),
        (["*", "!pkg/", "**/__pycache__"], "pkg/__pycache__/mod.pyc", True),
        (["*.md"], "docs/README.md", False),
        (["**/*.md"], "docs/README.md", True),
        (["*", "!README.md"], "README.md", False),
    ],
)
def test_dockerignore_matcher(patterns: list[str], path: str, excluded: bool) -> None:
    assert dockerignore_excludes(patterns, path) is excluded
