"""The snapshot cache: what each group of Envoys should hold, and who to tell when it changes.

In the spirit of go-control-plane's SnapshotCache: the cache decides *what* to send; the
streams (sotw.py, delta.py) decide *when*, following the protocol. Envoys are grouped by a
NodeHash (default: their `node.cluster`); a group without its own snapshot gets the default
group's, so a single-tenant deployment sets one snapshot and is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from envoy.config.core.v3 import base_pb2

from xds_server.xds.snapshot import Snapshot

__all__ = ["CacheEntry", "DEFAULT_GROUP", "NodeHash", "SnapshotCache", "by_node_cluster"]

logger = logging.getLogger(__name__)

DEFAULT_GROUP = ""


class NodeHash(Protocol):
    """Maps an Envoy's node identity to the group whose snapshot it receives."""

    def __call__(self, node: base_pb2.Node) -> str: ...


def by_node_cluster(node: base_pb2.Node) -> str:
    """Group Envoys by the `--service-cluster` (node.cluster) they announce."""
    return str(node.cluster)


_: NodeHash = by_node_cluster


@dataclass(frozen=True)
class CacheEntry:
    snapshot: Snapshot
    # Monotonic time the snapshot was set; push latency is measured from here.
    born: float


class SnapshotCache:
    """One snapshot per node group, and a watch list per group.

    Mutable state: `_entries` (group -> CacheEntry) and `_watchers` (group -> callbacks).
    Everything runs on one event loop; callbacks must not block (they enqueue).
    """

    def __init__(self, *, node_hash: NodeHash = by_node_cluster) -> None:
        self._node_hash = node_hash
        self._entries: dict[str, CacheEntry] = {}
        self._watchers: dict[str, set[Callable[[], None]]] = {}

    def group_of(self, node: base_pb2.Node) -> str:
        return self._node_hash(node)

    def set_snapshot(self, snapshot: Snapshot, *, group: str = DEFAULT_GROUP) -> bool:
        """Store `snapshot` for `group` and wake the streams it concerns.

        Returns False (and wakes nobody) when the group already has identical content.
        Raises InconsistentSnapshotError for a snapshot with dangling references.
        """
        snapshot.check_consistency()
        current = self._entries.get(group)
        if current is not None and current.snapshot.versions == snapshot.versions:
            return False
        self._entries[group] = CacheEntry(snapshot=snapshot, born=time.monotonic())
        logger.debug("Snapshot for group %r set: %s", group, dict(snapshot.versions))
        for watched_group, callbacks in self._watchers.items():
            if watched_group == group or (
                group == DEFAULT_GROUP and watched_group not in self._entries
            ):
                for callback in list(callbacks):
                    callback()
        return True

    def entry_for(self, group: str) -> CacheEntry | None:
        """The snapshot `group` receives, or None while there is none yet."""
        return self._entries.get(group) or self._entries.get(DEFAULT_GROUP)

    def watch(self, group: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` whenever `group`'s snapshot changes; returns the cancel function."""
        self._watchers.setdefault(group, set()).add(callback)

        def cancel() -> None:
            callbacks = self._watchers.get(group)
            if callbacks is not None:
                callbacks.discard(callback)
                if not callbacks:
                    del self._watchers[group]

        return cancel

    def to_json(self) -> dict[str, object]:
        return {
            group or "(default)": entry.snapshot.to_json() for group, entry in self._entries.items()
        }
