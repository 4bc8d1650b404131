"""Immutable snapshots of everything one group of Envoys should hold.

A snapshot is built once, checked for consistency, and never changed; a new state is a new
snapshot. Each resource is serialized exactly once, when the snapshot is built, into wire
fragments that every stream concatenates into its responses: protobuf merges concatenated
encodings of a message (repeated fields append), so
`DiscoveryResponse(version, type_url, nonce) ++ DiscoveryResponse(resources=[r1]) ++ ...` is
the encoding of one response holding r1, r2, ... Thousands of Envoys cost one serialization.

Versions are content hashes, never counters: the same content yields the same version on any
replica and after a restart, so an Envoy that reconnects with what it already has is not sent
it again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from xds_server.errors import InconsistentSnapshotError
from xds_server.xds.resources import ResourceType, name_of, references_of

__all__ = ["Resource", "Snapshot", "content_hash", "serialize_resources"]


def content_hash(*parts: bytes) -> str:
    """A short, deterministic hash of `parts` (64 bits, hex)."""
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


@dataclass(frozen=True)
class Resource:
    """One serialized resource and the wire fragments that carry it."""

    type: ResourceType
    name: str
    message: Message = field(repr=False, compare=False)
    # Hash of the deterministic serialization: the resource's version in Delta xDS.
    version: str
    # Names of `type.dependent` resources this one needs (see resources.references_of).
    references: frozenset[str]
    packed: any_pb2.Any = field(repr=False, compare=False)

    @classmethod
    def of(cls, resource_type: ResourceType, message: Message) -> Resource:
        if not isinstance(message, resource_type.message_class):
            raise TypeError(
                f"a {resource_type.name} resource must be a {resource_type.message_class.__name__},"
                f" not {type(message).__name__}"
            )
        value = message.SerializeToString(deterministic=True)
        return cls(
            type=resource_type,
            name=name_of(resource_type, message),
            message=message,
            version=content_hash(value),
            references=references_of(resource_type, message),
            packed=any_pb2.Any(type_url=resource_type.url, value=value),
        )

    @cached_property
    def sotw_fragment(self) -> bytes:
        """Encoding of a DiscoveryResponse holding only this resource."""
        return bytes(discovery_pb2.DiscoveryResponse(resources=[self.packed]).SerializeToString())

    @cached_property
    def delta_fragment(self) -> bytes:
        """Encoding of a DeltaDiscoveryResponse holding only this resource, with its version."""
        wrapped = discovery_pb2.Resource(name=self.name, version=self.version, resource=self.packed)
        return bytes(discovery_pb2.DeltaDiscoveryResponse(resources=[wrapped]).SerializeToString())


def serialize_resources(
    resource_type: ResourceType, messages: Iterable[Message]
) -> Mapping[str, Resource]:
    """`messages` serialized and keyed by name, in name order.

    Raises InconsistentSnapshotError for a name used twice."""
    named: dict[str, Resource] = {}
    for message in messages:
        resource = Resource.of(resource_type, message)
        if resource.name in named:
            raise InconsistentSnapshotError(
                f"two {resource_type.name} resources are named {resource.name!r}"
            )
        named[resource.name] = resource
    return MappingProxyType(dict(sorted(named.items())))


@dataclass(frozen=True)
class Snapshot:
    """Every resource of every type for one group of Envoys, with a version per type.

    Build it with `Snapshot.build` (or derive one with `replace` / `with_resources`), which
    refuse duplicate names and dangling references: a snapshot so made is consistent, and
    nothing needs to check it again.
    """

    resources: Mapping[ResourceType, Mapping[str, Resource]]
    versions: Mapping[ResourceType, str]

    @classmethod
    def build(cls, resources: Mapping[ResourceType, Iterable[Message]]) -> Snapshot:
        """Serialize `resources` and return a consistent snapshot.

        Raises InconsistentSnapshotError for a name used twice within a type, and
        for a reference to a resource the snapshot does not hold.
        """
        return cls.from_resources(
            {t: serialize_resources(t, resources.get(t, ())) for t in ResourceType}
        )

    @classmethod
    def from_resources(
        cls,
        by_type: Mapping[ResourceType, Mapping[str, Resource]],
        *,
        versions_of: Mapping[ResourceType, str] | None = None,
    ) -> Snapshot:
        """A snapshot of already-serialized resources (reused from an earlier snapshot);
        `versions_of` gives the versions of types already known (the same resources).

        Raises InconsistentSnapshotError for a dangling reference.
        """
        snapshot = cls._assemble(by_type, versions_of=versions_of or {})
        snapshot._check(ResourceType)
        return snapshot

    @classmethod
    def _assemble(
        cls,
        by_type: Mapping[ResourceType, Mapping[str, Resource]],
        *,
        versions_of: Mapping[ResourceType, str],
    ) -> Snapshot:
        versions = {
            t: versions_of.get(t)
            or content_hash(*(f"{n}={r.version}".encode() for n, r in sorted(by_type[t].items())))
            for t in ResourceType
        }
        return cls(resources=MappingProxyType(dict(by_type)), versions=MappingProxyType(versions))

    def replace(self, resource_type: ResourceType, resources: Iterable[Message]) -> Snapshot:
        """This snapshot with every resource of `resource_type` replaced; others are reused."""
        return self.with_resources(resource_type, serialize_resources(resource_type, resources))

    def with_resources(
        self, resource_type: ResourceType, resources: Mapping[str, Resource]
    ) -> Snapshot:
        """This snapshot with `resources` (already serialized, by name) as every resource
        of `resource_type`; the other types are reused as they are.

        Only the references into and out of `resource_type` are checked: the rest was
        checked when this snapshot was built. So swapping one Envoy's runtime layer, or a
        few pools' assignments, costs what changed, not the whole fleet.
        Raises InconsistentSnapshotError for a dangling reference.
        """
        if resources is self.resources[resource_type]:
            return self
        ordered = MappingProxyType(dict(sorted(resources.items())))
        snapshot = self._assemble(
            {**self.resources, resource_type: ordered},
            versions_of={t: v for t, v in self.versions.items() if t is not resource_type},
        )
        snapshot._check(
            t for t in ResourceType if resource_type in (t, t.dependent) and t.dependent
        )
        return snapshot

    def check_consistency(self) -> None:
        """Raise InconsistentSnapshotError if a resource references one this snapshot lacks.

        Every EDS cluster's ClusterLoadAssignment and every RDS route configuration a listener
        names must be present, or Envoy would keep that cluster or listener warming.
        """
        self._check(ResourceType)

    def _check(self, referring: Iterable[ResourceType]) -> None:
        """`check_consistency` for the references of the `referring` types only."""
        for resource_type in referring:
            dependent = resource_type.dependent
            if dependent is None:
                continue
            held = self.resources[dependent]
            for resource in self.resources[resource_type].values():
                if resource.references <= held.keys():
                    continue
                missing = sorted(resource.references - held.keys())
                raise InconsistentSnapshotError(
                    f"{resource_type.name} {resource.name!r} references {dependent.name}"
                    f" {', '.join(map(repr, missing))}, which the snapshot does not hold"
                )

    def names(self, resource_type: ResourceType) -> frozenset[str]:
        return frozenset(self.resources[resource_type])

    def to_json(self) -> dict[str, object]:
        """A summary for /debug/snapshot: versions and resource names with their versions."""
        return {
            t.short: {
                "version": self.versions[t],
                "resources": {n: r.version for n, r in self.resources[t].items()},
            }
            for t in ResourceType
        }
