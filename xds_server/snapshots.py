"""From a routing config and the policy's decision to one consistent xDS snapshot.

The seam between the pure Envoy builders (xds_server/envoy) and the xDS cache
(xds_server/xds): only the resource types whose inputs changed are rebuilt, so a weight
change is an EDS-only push and a new band limit an RTDS-only push (DESIGN.md: EDS-only
changes must not resend clusters, listeners or routes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xds_server import envoy
from xds_server.config import Band, RoutingConfig
from xds_server.envoy.routes import retry_after_of
from xds_server.envoy.runtime import admission_layer
from xds_server.policy.decision import Decision
from xds_server.policy.state import PoolState
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

__all__ = ["SnapshotBuilder"]


def _routing_part(config: RoutingConfig) -> RoutingConfig:
    """`config` without endpoints: what clusters, listeners and routes depend on."""
    return config.model_copy(
        update={"pools": tuple(p.model_copy(update={"endpoints": ()}) for p in config.pools)}
    )


@dataclass(frozen=True)
class _Built:
    routing: RoutingConfig
    # What EDS was built from (the whole config: endpoints, and pools' routing).
    config: RoutingConfig
    pools: Mapping[str, PoolState]
    runtime: Mapping[str, int]
    retry_after: Mapping[tuple[str, Band], int]
    snapshot: Snapshot


class SnapshotBuilder:
    """Builds snapshots; only the types whose inputs changed are rebuilt.

    A routing change rebuilds everything; an endpoints-only change (config endpoints, or
    the decision's endpoint states) only EDS; a change of band limits only RTDS; a change
    of Retry-After (a route property) only RDS. So Envoy is sent only those. The group's
    snapshot carries the limits of an Envoy the decision does not name yet; each named
    Envoy gets its own RTDS layer on top of it (`for_envoys`).

    Mutable state: the inputs of the last build and the snapshot built from them.
    """

    def __init__(self) -> None:
        self._last: _Built | None = None

    def build(self, config: RoutingConfig, decision: Decision | None = None) -> Snapshot:
        """A consistent snapshot for `config` and the policy's `decision`.

        Raises InconsistentSnapshotError or ResourceBuildError for resources that cannot be
        served.
        """
        decision = decision if decision is not None else Decision()
        routing = _routing_part(config)
        runtime = admission_layer(config, decision.admissions)
        retry_after = retry_after_of(decision.admissions)
        last = self._last
        if last is not None and last.routing == routing:
            snapshot = last.snapshot
            if last.config != config or last.pools != decision.pools:
                snapshot = snapshot.replace(
                    ResourceType.ENDPOINT, envoy.build_endpoints(config, decision)
                )
            if last.runtime != runtime:
                snapshot = snapshot.replace(ResourceType.RUNTIME, envoy.build_runtime(runtime))
            if last.retry_after != retry_after:
                snapshot = snapshot.replace(
                    ResourceType.ROUTE, envoy.build_routes(config, retry_after)
                )
        else:
            snapshot = Snapshot.build(
                {
                    ResourceType.RUNTIME: envoy.build_runtime(runtime),
                    ResourceType.CLUSTER: envoy.build_clusters(config),
                    ResourceType.ENDPOINT: envoy.build_endpoints(config, decision),
                    ResourceType.LISTENER: envoy.build_listeners(config),
                    ResourceType.ROUTE: envoy.build_routes(config, retry_after),
                }
            )
        self._last = _Built(
            routing=routing,
            config=config,
            pools=decision.pools,
            runtime=runtime,
            retry_after=retry_after,
            snapshot=snapshot,
        )
        return snapshot

    @staticmethod
    def for_envoys(
        config: RoutingConfig, decision: Decision, base: Snapshot
    ) -> dict[str, Snapshot]:
        """Per Envoy (node id) whose admission limits differ from `base`'s (the floor an
        Envoy the decision does not name gets): `base` with that Envoy's own RTDS layer.
        Every other resource is `base`'s, serialized once."""
        default = admission_layer(config, decision.admissions)
        nodes = sorted({node for a in decision.admissions.values() for node in a.by_envoy})
        own: dict[str, Snapshot] = {}
        for node_id in nodes:
            layer = admission_layer(config, decision.admissions, node_id)
            if layer != default:
                own[node_id] = base.replace(ResourceType.RUNTIME, envoy.build_runtime(layer))
        return own
