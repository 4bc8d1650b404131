"""Small helpers to build protobuf values the same way in every builder."""

from __future__ import annotations

from typing import Any as _Any

from google.protobuf import any_pb2, duration_pb2, wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

__all__ = ["duration", "pack", "uint32"]


def pack(message: _Any) -> _Any:
    """`message` packed into a `google.protobuf.Any` (for `typed_config` fields)."""
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def duration(seconds: float) -> _Any:
    """A `google.protobuf.Duration` of `seconds`, to the microsecond."""
    micros = round(seconds * 1_000_000)
    return duration_pb2.Duration(seconds=micros // 1_000_000, nanos=(micros % 1_000_000) * 1000)


def uint32(value: int) -> _Any:
    """A `google.protobuf.UInt32Value` (for optional integer fields)."""
    return wrappers_pb2.UInt32Value(value=value)
