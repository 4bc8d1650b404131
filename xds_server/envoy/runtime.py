"""Pure: runtime values in, the one RTDS Runtime resource out.

Runtime keys change Envoy's behaviour at once, without touching the resource they concern:
`circuit_breakers.<cluster>.default.max_requests` replaces a cluster's limit without a CDS
update (which would drop the cluster's idle connections and restart its counts). The
bootstrap declares an RTDS layer named `names.RUNTIME_LAYER_NAME` between its static layer
and its admin layer (bootstrap.py), and this builds the resource that fills it.

The layer is always sent, empty when there is nothing to set: Envoy waits for its RTDS
layers while it starts (up to `initial_fetch_timeout`), and a layer that is never sent would
hold its start-up that long.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf import struct_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.envoy import names

__all__ = ["build_runtime"]


def build_runtime(layer: Mapping[str, float | int | str | bool]) -> list[rtds_pb2.Runtime]:
    """The Runtime resource named `names.RUNTIME_LAYER_NAME` holding `layer`.

    Keys are inserted sorted, and snapshots serialize deterministically (map keys sorted),
    so the same values always make the same bytes and the same version.

    Numbers become Struct numbers (Envoy reads an integral number as an integer key, such
    as a circuit breaker limit). Raises ValueError for an empty key or a number that is not
    finite, and TypeError for a value of another type.
    """
    struct = struct_pb2.Struct()
    for key in sorted(layer):
        value = layer[key]
        if not key:
            raise ValueError("a runtime key cannot be empty")
        if isinstance(value, bool | str):
            struct[key] = value
        elif isinstance(value, int | float):
            if not math.isfinite(value):
                raise ValueError(f"runtime key {key!r} has a value that is not finite: {value}")
            struct[key] = value
        else:
            raise TypeError(
                f"runtime key {key!r} must be a number, a string or a bool,"
                f" not {type(value).__name__}"
            )
    return [rtds_pb2.Runtime(name=names.RUNTIME_LAYER_NAME, layer=struct)]
