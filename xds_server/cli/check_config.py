"""`xds-server check-config FILE`: the server's own checks of a routing document, offline,
for CI before a config is applied.

The document is read and validated as the server reads and validates it (the same size,
alias and depth limits, then `parse_config`), and its Envoy resources are built as the
server builds them (a model named like one of the gateway's sentinels fails only there).
Nothing is fetched and nothing listens. With `--previous`, the document is also judged as
an edit of the one in force: one that takes away the last of a pool's listed endpoints is
refused, as the server refuses it. A pool left without endpoints passes with a warning, as
the server accepts it.

Exit status 0: valid (warnings on stderr). 1: refused, every problem on its own line of
stderr as `FILE: path.to.field: message`. 2: a usage error.
"""

from __future__ import annotations

import sys
from pathlib import Path

from xds_server.config import ParseLimits, RoutingConfig, parse_config, read_document
from xds_server.errors import ConfigError, XdsServerError
from xds_server.snapshot_builder import SnapshotBuilder
from xds_server.sources.config_document import pools_without_endpoints, refuse_emptied_pools

__all__ = ["STDIN", "check_config"]

# The FILE that means standard input.
STDIN = "-"

_LIMITS = ParseLimits()


def check_config(file: str, *, previous: Path | None = None, kubernetes: bool = False) -> int:
    """Check the document at `file` (STDIN: standard input), report on stdout and stderr,
    and return the exit status (module docstring). `kubernetes`: judge it as a server run
    with --kubernetes does (its pools' selectors are followed)."""
    source = "<stdin>" if file == STDIN else file
    try:
        config = _parse(_read(file), source=source)
        _build(config, source=source)
    except ConfigError as exc:
        return _refused(exc, source=source)
    if previous is not None:
        try:
            before = _parse(read_document(previous, limits=_LIMITS), source=str(previous))
        except ConfigError as exc:
            return _refused(exc, source=str(previous))
        try:
            refuse_emptied_pools(before, config, source=source, selectors_followed=kubernetes)
        except ConfigError as exc:
            return _refused(exc, source=source)
    empty = pools_without_endpoints(config, selectors_followed=kubernetes)
    if empty:
        why = (
            "no endpoints and no selector"
            if kubernetes
            else "no endpoints (a selector is followed only with --kubernetes)"
        )
        print(
            f"{source}: warning: {len(empty)} pool(s) have {why}: {', '.join(map(repr, empty))};"
            " their models would be answered 503 no_healthy_upstream",
            file=sys.stderr,
        )
    models = sum(len(pool.models) + len(pool.adapters) for pool in config.pools)
    print(f"{source}: valid ({len(config.pools)} pool(s), {models} model(s) and adapter(s))")
    return 0


def _refused(exc: ConfigError, *, source: str) -> int:
    """Print each problem of `exc` on its own line (or its message), return exit status 1."""
    for line in [f"{source}: {problem}" for problem in exc.problems] or [str(exc)]:
        print(line, file=sys.stderr)
    return 1


def _read(file: str) -> bytes:
    if file != STDIN:
        return read_document(Path(file), limits=_LIMITS)
    document = sys.stdin.buffer.read(_LIMITS.max_bytes + 1)
    _LIMITS.check_size(len(document), source="<stdin>")
    return document


def _parse(document: bytes, *, source: str) -> RoutingConfig:
    return parse_config(document, source=source, limits=_LIMITS)


def _build(config: RoutingConfig, *, source: str) -> None:
    """Build the snapshot the server would build before any pod is scraped."""
    try:
        SnapshotBuilder().build(config)
    except XdsServerError as exc:
        raise ConfigError(f"{source}: refused: {exc}") from exc
