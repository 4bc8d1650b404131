"""The routing config from a local file, re-read when its content changes.

The file's directory is watched with inotify (Linux), so a change is read at once, and
polled every `interval_s` all the same (by default once a second): the poll works on every
filesystem, catches what inotify cannot see (a network filesystem, a watch the kernel
dropped) and the symlink swaps Kubernetes uses for mounted ConfigMaps. A poll costs a stat
and, when the file's identity, size or time changed, one read. Nothing here blocks the
event loop: the file is read in a worker thread, and only after its size is checked
(`ParseLimits.max_bytes`, 1 MiB), and parsed in a child process kept warm
(`config_document.ChildParser`). From the write to a parsed config: about 0.1 s for a
10,000-endpoint JSON document (bench/fleet.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from xds_server.config import ParseLimits, RoutingConfig, read_document
from xds_server.errors import ConfigError
from xds_server.sources.config_document import (
    PARSE_TIMEOUT_S,
    ChildParser,
    refuse_emptied_pools,
    warn_empty_pools,
)
from xds_server.telemetry import Telemetry

if TYPE_CHECKING:
    from asyncinotify import Inotify

__all__ = ["watch_config_file"]

logger = logging.getLogger(__name__)

_LIMITS = ParseLimits()
# However unchanged the file looks (identity, size, times), every this many looks it is
# read all the same: a filesystem whose times are coarse could hide an edit of one size.
_READ_ANYWAY_EVERY = 10
# After a change to the file's directory, how long nothing more must happen before it is
# read.
_SETTLE_S = 0.02
_SETTLE_MAX_S = 0.5


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

    A config that takes away the last of a pool's listed endpoints, compared with the one
    yielded last, is yielded as a ConfigError (`refuse_emptied_pools`). A config accepted
    with pools it leaves without endpoints is yielded after a warning (`warn_empty_pools`;
    `selectors_followed` when Kubernetes discovery follows the pools' selectors,
    `telemetry` to count it). `_iterations` bounds the number of polls (tests only).
    """
    parser = ChildParser()
    try:
        with _DirectoryEvents(path.parent) as events:
            async for item in _follow(
                path,
                events=events,
                parser=parser,
                interval_s=interval_s,
                limits=limits,
                parse_timeout_s=parse_timeout_s,
                selectors_followed=selectors_followed,
                telemetry=telemetry,
                iterations=_iterations,
            ):
                yield item
    finally:
        await parser.aclose()


async def _follow(
    path: Path,
    *,
    events: _DirectoryEvents,
    parser: ChildParser,
    interval_s: float,
    limits: ParseLimits,
    parse_timeout_s: float,
    selectors_followed: bool,
    telemetry: Telemetry | None,
    iterations: int | None,
) -> AsyncIterator[RoutingConfig | ConfigError]:
    source = str(path)
    # The config yielded last: what a new one may not empty pools of.
    accepted: RoutingConfig | None = None
    last_digest: bytes | None = None
    last_stat: tuple[int, ...] | None = None
    polls = 0
    while iterations is None or polls < iterations:
        polls += 1
        stat = await asyncio.to_thread(_identity_of, path)
        if stat is not None and stat == last_stat and polls % _READ_ANYWAY_EVERY:
            await events.wait(interval_s)
            continue
        last_stat = stat
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
                    config = await parser.parse(
                        document, source=source, limits=limits, timeout_s=parse_timeout_s
                    )
                    refuse_emptied_pools(
                        accepted, config, source=source, selectors_followed=selectors_followed
                    )
                except ConfigError as exc:
                    parsed = exc
                else:
                    warn_empty_pools(
                        config,
                        source=source,
                        selectors_followed=selectors_followed,
                        telemetry=telemetry,
                    )
                    parsed = accepted = config
                yield parsed
        await events.wait(interval_s)


def _identity_of(path: Path) -> tuple[int, ...] | None:
    """What tells a changed file from the same one without reading it (the symlink
    followed: a ConfigMap swap is a new inode); None when it cannot be told."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_dev, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


class _DirectoryEvents:
    """Wakes on any inotify event in one directory, or after a timeout. Where inotify is
    not to be had (not Linux, no such directory, out of watches) only the timeout wakes:
    the caller then polls, as it would anyway.

    Mutable state: the inotify handle (None without one).
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._inotify: Inotify | None = None

    def __enter__(self) -> _DirectoryEvents:
        try:
            from asyncinotify import Inotify, Mask  # Linux only: imported where it is used

            inotify = Inotify()
        except (ImportError, OSError) as exc:
            logger.info("No inotify (%s): the config file is polled only.", exc)
            return self
        # Whatever can change what the file reads as: written, moved in (a rename, a
        # ConfigMap's symlink swap), created, deleted, its attributes.
        mask = (
            Mask.CLOSE_WRITE
            | Mask.MODIFY
            | Mask.MOVED_TO
            | Mask.MOVED_FROM
            | Mask.CREATE
            | Mask.DELETE
            | Mask.ATTRIB
        )
        try:
            inotify.add_watch(self._directory, mask)
        except OSError as exc:
            inotify.close()
            logger.info(
                "Cannot watch %s (%s): the config file is polled only.", self._directory, exc
            )
            return self
        self._inotify = inotify
        return self

    def __exit__(self, *_: object) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    async def wait(self, timeout_s: float) -> None:
        """Return after `timeout_s`, or once events came and then none for `_SETTLE_S`: a
        file written in several pieces (an editor, `cat >`) is read once it is whole, not
        refused half-written."""
        if self._inotify is None:
            await asyncio.sleep(timeout_s)
            return
        try:
            async with asyncio.timeout(timeout_s):
                await self._inotify.get()
        except TimeoutError:
            return
        # A directory that never goes quiet (another file written all the time) still
        # gets its look within _SETTLE_MAX_S.
        settle_until = asyncio.get_running_loop().time() + _SETTLE_MAX_S
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(settle_until):
                while True:
                    try:
                        async with asyncio.timeout(_SETTLE_S):
                            await self._inotify.get()
                    except TimeoutError:
                        return
