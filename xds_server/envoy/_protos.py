"""Small helpers to build protobuf values the same way in every builder."""

from __future__ import annotations

from typing import Any as _Any

from google.protobuf import any_pb2, duration_pb2, wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

__all__ = ["duration", "pack", "uint32"]


def pack(message: _Any) -> _Any:
    """`message` packed into a `google.protobuf.Any` (for `typed_config` fields).

    Serialized deterministically: the packed bytes are part of the enclosing resource, whose
    version is a hash of them, and a map inside (a `Struct`'s fields, as in the local reply
    bodies) would otherwise come out in an order that differs between processes, so that
    replicas and restarts would disagree on versions of identical resources.
    """
    packed = any_pb2.Any()
    packed.Pack(message, deterministic=True)
    return packed


def duration(seconds: float) -> _Any:
    """A `google.protobuf.Duration` of `seconds`, to the microsecond."""
    micros = round(seconds * 1_000_000)
    return duration_pb2.Duration(seconds=micros // 1_000_000, nanos=(micros % 1_000_000) * 1000)


def uint32(value: int) -> _Any:
    """A `google.protobuf.UInt32Value` (for optional integer fields)."""
    return wrappers_pb2.UInt32Value(value=value)


def uint64(value: int) -> _Any:
    """A `google.protobuf.UInt64Value`."""
    return wrappers_pb2.UInt64Value(value=value)
