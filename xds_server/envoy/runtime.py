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

from xds_server.config import BANDS, PoolConfig, RoutingConfig
from xds_server.envoy import names
from xds_server.errors import ResourceBuildError
from xds_server.policy.admission import PoolAdmission

__all__ = ["admission_layer", "build_runtime", "max_requests_key", "pool_admission_layer"]


def max_requests_key(cluster: str) -> str:
    """The runtime key that overrides `cluster`'s circuit breaker limit (default priority)."""
    return f"circuit_breakers.{cluster}.default.max_requests"


def admission_layer(
    config: RoutingConfig, admissions: Mapping[str, PoolAdmission], node_id: str | None = None
) -> dict[str, int]:
    """The runtime keys that enforce each pool's admission at Envoy `node_id` (None: at an
    Envoy the admission does not name, which gets the floor): every band cluster of the
    pool (one per lane, names.band_clusters) gets its lane's part of that Envoy's limit for
    the band, and every weighted tenant's cluster its part of the tenant's share. Pools of
    `admissions` that the config does not have are ignored."""
    layer: dict[str, int] = {}
    for pool in config.pools:
        admission = admissions.get(pool.name)
        if admission is not None:
            layer.update(pool_admission_layer(config, pool, admission, node_id))
    return layer


def pool_admission_layer(
    config: RoutingConfig, pool: PoolConfig, admission: PoolAdmission, node_id: str | None
) -> dict[str, int]:
    """`admission_layer`'s keys for one pool."""
    clusters = names.band_clusters(config, pool)
    layer = {
        max_requests_key(cluster): admission.lane_limit(node_id, band, lane)
        for band in BANDS
        for lane, cluster in zip(config.lanes(pool), clusters[band], strict=True)
    }
    for band, lanes in names.tenant_clusters(config, pool).items():
        for tenant, cluster in lanes.items():
            layer[max_requests_key(cluster)] = admission.tenant_limit(node_id, band, tenant)
    return layer


def build_runtime(layer: Mapping[str, float | int | str | bool]) -> list[rtds_pb2.Runtime]:
    """The Runtime resource named `names.RUNTIME_LAYER_NAME` holding `layer`.

    Keys are inserted sorted, and snapshots serialize deterministically (map keys sorted),
    so the same values always make the same bytes and the same version.

    Numbers become Struct numbers (Envoy reads an integral number as an integer key, such
    as a circuit breaker limit). Raises ResourceBuildError for an empty key or a number that is not
    finite, and TypeError for a value of another type.
    """
    struct = struct_pb2.Struct()
    for key in sorted(layer):
        value = layer[key]
        if not key:
            raise ResourceBuildError("a runtime key cannot be empty")
        if isinstance(value, bool | str):
            struct[key] = value
        elif isinstance(value, int | float):
            if not math.isfinite(value):
                raise ResourceBuildError(
                    f"runtime key {key!r} has a value that is not finite: {value}"
                )
            struct[key] = value
        else:
            raise TypeError(
                f"runtime key {key!r} must be a number, a string or a bool,"
                f" not {type(value).__name__}"
            )
    return [rtds_pb2.Runtime(name=names.RUNTIME_LAYER_NAME, layer=struct)]
