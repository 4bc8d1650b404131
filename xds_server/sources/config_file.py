"""The routing config from a local file, re-read when its content changes.

Polling (by default once a second) rather than inotify: it works the same on every
filesystem, including the symlink swaps Kubernetes uses for mounted ConfigMaps, and costs a
stat and, on change, one read. Nothing here blocks the event loop: the file is read in a
worker thread, and only after its size is checked (`ParseLimits.max_bytes`, 1 MiB), and
parsed in a child process (`config_document.parse_in_child`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from xds_server.config import ParseLimits, RoutingConfig, read_document
from xds_server.errors import ConfigError
from xds_server.sources.config_document import PARSE_TIMEOUT_S, parse_in_child, warn_empty_pools
from xds_server.telemetry import Telemetry

__all__ = ["watch_config_file"]

logger = logging.getLogger(__name__)

_LIMITS = ParseLimits()


async def watch_config_file(
    path: Path,
    *,
    interval_s: float = 1.0,
    limits: ParseLimits = _LIMITS,
    parse_timeout_s: float = PARSE_TIMEOUT_S,
    selectors_followed: bool = False,
    telemetry: Telemetry | None = None,
    _iterations: int | None = None,
) -> AsyncIterator[RoutingConfig | ConfigError]:
    """Yield the parsed config now and after every content change; errors are yielded, not raised.

    A config accepted with pools it leaves without endpoints is yielded after a warning
    (`warn_empty_pools`; `selectors_followed` when Kubernetes discovery follows the pools'
    selectors, `telemetry` to count it). `_iterations` bounds the number of polls (tests
    only).
    """
    source = str(path)
    last_digest: bytes | None = None
    polls = 0
    while _iterations is None or polls < _iterations:
        polls += 1
        try:
            document = await asyncio.to_thread(read_document, path, limits=limits)
        except ConfigError as exc:
            # Unreadable or too big: said again only when that changes.
            digest = str(exc).encode()
            if digest != last_digest:
                last_digest = digest
                yield exc
        else:
            digest = hashlib.sha256(document).digest()
            if digest != last_digest:
                last_digest = digest
                parsed: RoutingConfig | ConfigError
                try:
                    parsed = await parse_in_child(
                        document, source=source, limits=limits, timeout_s=parse_timeout_s
                    )
                except ConfigError as exc:
                    parsed = exc
                else:
                    warn_empty_pools(
                        parsed,
                        source=source,
                        selectors_followed=selectors_followed,
                        telemetry=telemetry,
                    )
                yield parsed
        await asyncio.sleep(interval_s)
