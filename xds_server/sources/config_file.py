"""The routing config from a local file, re-read when its content changes.

Polling (by default once a second) rather than inotify: it works the same on every
filesystem, including the symlink swaps Kubernetes uses for mounted ConfigMaps, and costs a
stat and, on change, one read. Reads run in a worker thread so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from xds_server.config import RoutingConfig, parse_config
from xds_server.errors import ConfigError

__all__ = ["watch_config_file"]

logger = logging.getLogger(__name__)


async def watch_config_file(
    path: Path, *, interval_s: float = 1.0, _iterations: int | None = None
) -> AsyncIterator[RoutingConfig | ConfigError]:
    """Yield the parsed config now and after every content change; errors are yielded, not raised.

    `_iterations` bounds the number of polls (tests only).
    """
    last_digest: bytes | None = None
    polls = 0
    while _iterations is None or polls < _iterations:
        polls += 1
        try:
            document = await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            digest = f"unreadable:{exc.errno}".encode()
            if digest != last_digest:
                last_digest = digest
                yield ConfigError(f"{path}: cannot read: {exc.strerror}")
        else:
            digest = hashlib.sha256(document).digest()
            if digest != last_digest:
                last_digest = digest
                parsed: RoutingConfig | ConfigError
                try:
                    parsed = parse_config(document, source=str(path))
                except ConfigError as exc:
                    parsed = exc
                yield parsed
        await asyncio.sleep(interval_s)
