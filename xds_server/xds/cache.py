"""The snapshot cache: what each group of Envoys should hold, and who to tell when it changes.

In the spirit of go-control-plane's SnapshotCache: the cache decides *what* to send; the
streams (sotw.py, delta.py) decide *when*, following the protocol. Envoys are grouped by a
NodeHash (default: their `node.cluster`); a group without its own snapshot gets the default
group's, so a single-tenant deployment sets one snapshot and is done.

A group's snapshot may come with snapshots for single Envoys of the group (by node id),
which differ from it only where an Envoy needs its own values (its admission limits,
RTDS); they share every other serialized resource with the group's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from envoy.config.core.v3 import base_pb2

from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

__all__ = [
    "CacheEntry",
    "DEFAULT_GROUP",
    "NodeHash",
    "SnapshotCache",
    "WAKE_BATCH",
    "by_node_cluster",
]

logger = logging.getLogger(__name__)

DEFAULT_GROUP = ""
# Streams woken per pass of the event loop when a snapshot changes (_wake_in_batches).
WAKE_BATCH = 32


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


def _wake_in_batches(callbacks: list[Callable[[], None]]) -> None:
    """Call `callbacks`, WAKE_BATCH now and WAKE_BATCH more per pass of the event loop: each
    wakes a stream that then builds and sends its response, and 500 streams woken at once
    would all run in one pass, holding ACKs, load reports and probes for 100 ms."""
    for callback in callbacks[:WAKE_BATCH]:
        callback()
    if len(callbacks) > WAKE_BATCH:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test): all at once
            for callback in callbacks[WAKE_BATCH:]:
                callback()
            return
        loop.call_soon(_wake_in_batches, callbacks[WAKE_BATCH:])


class SnapshotCache:
    """One snapshot per node group (and per Envoy where it needs its own), and a watch list
    per Envoy.

    Mutable state: `_entries` (group -> CacheEntry), `_node_entries` (group -> node id ->
    CacheEntry) and `_watchers` ((group, node id) -> callbacks). Everything runs on one
    event loop; callbacks must not block (they enqueue).
    """

    def __init__(self, *, node_hash: NodeHash = by_node_cluster) -> None:
        self._node_hash = node_hash
        self._entries: dict[str, CacheEntry] = {}
        self._node_entries: dict[str, dict[str, CacheEntry]] = {}
        self._watchers: dict[tuple[str, str], set[Callable[[], None]]] = {}

    def group_of(self, node: base_pb2.Node) -> str:
        return self._node_hash(node)

    def set_snapshot(
        self,
        snapshot: Snapshot,
        *,
        group: str = DEFAULT_GROUP,
        nodes: Mapping[str, Snapshot] | None = None,
    ) -> bool:
        """Store `snapshot` for `group`, and `nodes` (node id -> snapshot) for those Envoys
        of it that get their own (replacing the group's earlier ones); wake every stream
        whose content changed.

        Returns False (and wakes nobody) when nothing changed. The snapshots are not
        checked again: a Snapshot is consistent by construction (snapshot.py).
        """
        nodes = nodes or {}
        before = {key: self._versions(*key) for key in self._watchers}
        now = time.monotonic()
        changed = self._store(self._entries, group, snapshot, now)
        kept = self._node_entries.get(group, {})
        fresh: dict[str, CacheEntry] = {}
        for node_id, node_snapshot in nodes.items():
            changed |= self._store(kept, node_id, node_snapshot, now)
            fresh[node_id] = kept[node_id]
        changed |= kept.keys() != fresh.keys()
        self._node_entries[group] = fresh
        if not changed:
            return False
        logger.debug(
            "Snapshot for group %r set: %s (and %d Envoys' own).",
            group,
            dict(snapshot.versions),
            len(nodes),
        )
        woken = [
            callback
            for key, versions in before.items()
            if self._versions(*key) != versions
            for callback in list(self._watchers.get(key, ()))
        ]
        _wake_in_batches(woken)
        return True

    @staticmethod
    def _store(entries: dict[str, CacheEntry], key: str, snapshot: Snapshot, now: float) -> bool:
        """Put `snapshot` at `key` unless it holds the same content (its birth is kept)."""
        current = entries.get(key)
        if current is not None and current.snapshot.versions == snapshot.versions:
            return False
        entries[key] = CacheEntry(snapshot=snapshot, born=now)
        return True

    def cluster_names(self) -> frozenset[str]:
        """Every cluster some snapshot holds: the only ones an Envoy may report on."""
        return frozenset(
            name
            for entry in self._entries.values()
            for name in entry.snapshot.resources[ResourceType.CLUSTER]
        )

    def entry_for(self, group: str, node_id: str = "") -> CacheEntry | None:
        """The snapshot Envoy `node_id` of `group` receives, or None while there is none:
        its own, else its group's, else the default group's (and its own there)."""
        serving = group if group in self._entries else DEFAULT_GROUP
        own = self._node_entries.get(serving, {}).get(node_id)
        return own or self._entries.get(serving)

    def _versions(self, group: str, node_id: str) -> Mapping[ResourceType, str] | None:
        entry = self.entry_for(group, node_id)
        return None if entry is None else entry.snapshot.versions

    def watch(
        self, group: str, callback: Callable[[], None], node_id: str = ""
    ) -> Callable[[], None]:
        """Call `callback` whenever what Envoy `node_id` of `group` receives changes;
        returns the cancel function."""
        key = (group, node_id)
        self._watchers.setdefault(key, set()).add(callback)

        def cancel() -> None:
            callbacks = self._watchers.get(key)
            if callbacks is not None:
                callbacks.discard(callback)
                if not callbacks:
                    del self._watchers[key]

        return cancel

    def to_json(self) -> dict[str, object]:
        """For /debug/snapshot: each group's snapshot, and the versions of the Envoys that
        have their own (by group and node id)."""
        return {
            "groups": {
                group or "(default)": entry.snapshot.to_json()
                for group, entry in self._entries.items()
            },
            "envoys": {
                group or "(default)": {
                    node_id: {t.short: v for t, v in own.snapshot.versions.items()}
                    for node_id, own in sorted(nodes.items())
                }
                for group, nodes in self._node_entries.items()
                if nodes
            },
        }
