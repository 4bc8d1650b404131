"""From a routing config and the policy's decision to one consistent xDS snapshot.

The seam between the pure Envoy builders (xds_server/envoy) and the xDS cache
(xds_server/xds). Work is paid only for what changed, at fleet size (100 pools of 100
pods, hundreds of Envoys) as at four pods:

- only the resource types whose inputs changed are rebuilt, so a weight change is an
  EDS-only push and a new band limit an RTDS-only push (DESIGN.md: EDS-only changes must
  not resend clusters, listeners or routes);
- within EDS, only the pools whose endpoints or states changed are rebuilt and
  serialized again; the others' ClusterLoadAssignments are the same Resource objects, so
  the streams see their versions unchanged and send only the changed ones;
- each Envoy's own runtime layer (its admission limits) is the group's layer with that
  Envoy's keys over it: each pool's keys per Envoy are worked out again only when the
  pool's admission changed, each distinct layer is serialized once, and an Envoy's
  snapshot is rebuilt only when its layer or the group's snapshot changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from xds_server import envoy
from xds_server.config import BANDS, Band, PoolConfig, RoutingConfig
from xds_server.envoy import names
from xds_server.envoy.routes import retry_after_of
from xds_server.envoy.runtime import admission_layer, max_requests_key
from xds_server.errors import InconsistentSnapshotError
from xds_server.policy.admission import PoolAdmission, TenantAdmission
from xds_server.policy.decision import Decision
from xds_server.policy.failover import PoolFailover
from xds_server.policy.state import PoolState
from xds_server.steps import Steps, complete
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Resource, Snapshot, serialize_resources

__all__ = ["SnapshotBuilder", "tenant_envoys"]

# Envoys' own snapshots made between two steps (for_envoys_steps): about a millisecond.
_ENVOYS_PER_STEP = 64


def _routing_part(config: RoutingConfig) -> RoutingConfig:
    """`config` without endpoints: what clusters, listeners and routes depend on."""
    return config.model_copy(
        update={"pools": tuple(p.model_copy(update={"endpoints": ()}) for p in config.pools)}
    )


@dataclass(frozen=True)
class _Built:
    routing: RoutingConfig
    runtime: Mapping[str, int]
    retry_after: Mapping[tuple[str, Band], int]
    tenant_envoys: int
    snapshot: Snapshot


# What a pool's assignments are built from: its config, the policy's state of it (None: from
# config), whether its spilling pods go to its spill listener, and its failover (None: no
# remotes).
_PoolKey = tuple[PoolConfig, PoolState | None, bool, PoolFailover | None, bool]
# A pool's runtime keys, by Envoy, where they differ from those of an Envoy not named.
_EnvoyKeys = Mapping[str, Mapping[str, int]]


class SnapshotBuilder:
    """Builds snapshots, rebuilding only what changed (module docstring).

    Mutable state, each from the last build: its inputs and snapshot (`_last`); each
    pool's assignments and what they were built from (`_assignments`); each pool's
    per-Envoy runtime keys and the admission they came from (`_envoy_keys`); the runtime
    layers serialized, by the Envoy keys over the group's layer (`_layers`, over
    `_layers_over`); and each Envoy's own snapshot with the group snapshot and layer it
    was made of (`_envoys`).
    A change of routing (clusters, listeners, routes) clears the per-Envoy caches.
    """

    def __init__(self) -> None:
        self._last: _Built | None = None
        self._assignments: dict[str, tuple[_PoolKey, Mapping[str, Resource]]] = {}
        self._envoy_keys: dict[str, tuple[tuple[PoolConfig, PoolAdmission], _EnvoyKeys]] = {}
        self._layers: dict[tuple[tuple[str, int], ...], Resource] = {}
        self._layers_over: Mapping[str, int] = {}
        self._envoys: dict[str, tuple[Snapshot, Resource, Snapshot]] = {}

    def build(self, config: RoutingConfig, decision: Decision | None = None) -> Snapshot:
        """A consistent snapshot for `config` and the policy's `decision`.

        Raises InconsistentSnapshotError or ResourceBuildError for resources that cannot be
        served.
        """
        return complete(self.build_steps(config, decision))

    def build_steps(
        self, config: RoutingConfig, decision: Decision | None = None
    ) -> Steps[Snapshot]:
        """`build` in steps: one per pool whose assignments are built anew, and one per
        resource type built anew (steps.py)."""
        decision = decision if decision is not None else Decision()
        routing = _routing_part(config)
        runtime = admission_layer(config, decision.admissions)
        retry_after = retry_after_of(decision.admissions)
        envoys = tenant_envoys(config, decision)
        endpoints, endpoints_changed, assignments = yield from self._endpoints(config, decision)
        last = self._last
        if last is not None and last.routing == routing:
            snapshot = last.snapshot
            if endpoints_changed:
                snapshot = snapshot.with_resources(ResourceType.ENDPOINT, endpoints)
            if last.runtime != runtime:
                snapshot = snapshot.replace(ResourceType.RUNTIME, envoy.build_runtime(runtime))
            if last.retry_after != retry_after or last.tenant_envoys != envoys:
                snapshot = snapshot.replace(
                    ResourceType.ROUTE, envoy.build_routes(config, retry_after, envoys=envoys)
                )
        else:
            self._envoy_keys, self._layers, self._envoys = {}, {}, {}
            runtime_resources = serialize_resources(
                ResourceType.RUNTIME, envoy.build_runtime(runtime)
            )
            clusters = serialize_resources(ResourceType.CLUSTER, envoy.build_clusters(config))
            yield
            listeners = serialize_resources(ResourceType.LISTENER, envoy.build_listeners(config))
            yield
            routes = serialize_resources(
                ResourceType.ROUTE, envoy.build_routes(config, retry_after, envoys=envoys)
            )
            yield
            snapshot = Snapshot.from_resources(
                {
                    ResourceType.RUNTIME: runtime_resources,
                    ResourceType.CLUSTER: clusters,
                    ResourceType.ENDPOINT: endpoints,
                    ResourceType.LISTENER: listeners,
                    ResourceType.ROUTE: routes,
                }
            )
        # Only now: a build that fails part way leaves the caches as the last snapshot is.
        self._assignments = assignments
        self._last = _Built(
            routing=routing,
            runtime=runtime,
            retry_after=retry_after,
            tenant_envoys=envoys,
            snapshot=snapshot,
        )
        return snapshot

    def _endpoints(
        self, config: RoutingConfig, decision: Decision
    ) -> Steps[
        tuple[Mapping[str, Resource], bool, dict[str, tuple[_PoolKey, Mapping[str, Resource]]]]
    ]:
        """Every pool's assignments by name, whether any pool's changed since the last
        build, and each pool's with what it was built from (the cache to keep once the
        build succeeds); a pool whose inputs did not change keeps its serialized
        resources."""
        fresh: dict[str, tuple[_PoolKey, Mapping[str, Resource]]] = {}
        merged: dict[str, Resource] = {}
        changed = False
        for pool in config.pools:
            key: _PoolKey = (
                pool,
                decision.pools.get(pool.name),
                config.spills(pool),
                decision.failover.get(pool.name),
                config.bucket_homes(pool),
            )
            cached = self._assignments.get(pool.name)
            if cached is not None and cached[0] == key:
                resources = cached[1]
            else:
                changed = True
                resources = serialize_resources(
                    ResourceType.ENDPOINT,
                    envoy.build_pool_endpoints(
                        pool, key[1], spills=key[2], failover=key[3], buckets=key[4]
                    ),
                )
                yield
            fresh[pool.name] = (key, resources)
            for name, resource in resources.items():
                if name in merged:
                    raise InconsistentSnapshotError(f"two ENDPOINT resources are named {name!r}")
                merged[name] = resource
        changed = changed or fresh.keys() != self._assignments.keys()
        return MappingProxyType(merged), changed, fresh

    def for_envoys(
        self, config: RoutingConfig, decision: Decision, base: Snapshot
    ) -> dict[str, Snapshot]:
        """Per Envoy (node id) whose admission limits differ from `base`'s (the floor an
        Envoy the decision does not name gets): `base` with that Envoy's own RTDS layer.
        Every other resource is `base`'s, serialized once. Call after `build`, with the
        snapshot it returned."""
        return complete(self.for_envoys_steps(config, decision, base))

    def for_envoys_steps(
        self, config: RoutingConfig, decision: Decision, base: Snapshot
    ) -> Steps[dict[str, Snapshot]]:
        """`for_envoys` in steps: one per pool whose Envoys' keys are worked out anew,
        and one per batch of Envoys (steps.py)."""
        # Per Envoy, its keys of each pool (in config order, so its layer's content is
        # deterministic without sorting): Envoys with the same limits share these mappings.
        parts: dict[str, list[Mapping[str, int]]] = {}
        fresh: dict[str, tuple[tuple[PoolConfig, PoolAdmission], _EnvoyKeys]] = {}
        for pool in config.pools:
            admission = decision.admissions.get(pool.name)
            if admission is None:
                continue
            key = (pool, admission)
            cached = self._envoy_keys.get(pool.name)
            keys = cached[1] if cached is not None and cached[0] == key else None
            if keys is None:
                keys = _envoy_keys(config, pool, admission)
                yield
            fresh[pool.name] = (key, keys)
            for node_id, layer in keys.items():
                parts.setdefault(node_id, []).append(layer)
        self._envoy_keys = fresh
        group_layer = admission_layer(config, decision.admissions)
        if group_layer != self._layers_over:
            self._layers, self._layers_over = {}, group_layer
        # Envoys whose parts are the same objects have the same layer: its content is
        # worked out, looked up and serialized once for all of them.
        by_parts: dict[tuple[int, ...], Resource] = {}
        layers: dict[tuple[tuple[str, int], ...], Resource] = {}
        envoys: dict[str, tuple[Snapshot, Resource, Snapshot]] = {}
        for count, node_id in enumerate(sorted(parts), start=1):
            if count % _ENVOYS_PER_STEP == 0:
                yield
            identity = tuple(map(id, parts[node_id]))
            resource = by_parts.get(identity)
            if resource is None:
                own = tuple(item for layer in parts[node_id] for item in layer.items())
                resource = layers.get(own) or self._layers.get(own)
                if resource is None:
                    (resource,) = serialize_resources(
                        ResourceType.RUNTIME, envoy.build_runtime({**group_layer, **dict(own)})
                    ).values()
                layers[own] = by_parts[identity] = resource
            cached_envoy = self._envoys.get(node_id)
            if cached_envoy is not None and cached_envoy[0] is base and cached_envoy[1] is resource:
                envoys[node_id] = cached_envoy
            else:
                snapshot = base.with_resources(ResourceType.RUNTIME, {resource.name: resource})
                envoys[node_id] = (base, resource, snapshot)
        self._layers, self._envoys = layers, envoys
        return {node_id: snapshot for node_id, (_, _, snapshot) in envoys.items()}


def tenant_envoys(config: RoutingConfig, decision: Decision) -> int:
    """The number of Envoys each tenant's request rate is split over: every Envoy of the
    fleet the admissions know (flow control's load, over every replica: the same number
    on each), at least 1; 1 when no tenant has a rate limit, so that Envoys coming and
    going push no routes."""
    if not config.flow_control.tenants.rate_limited():
        return 1
    fleet = {node for admission in decision.admissions.values() for node in admission.by_envoy}
    return max(1, len(fleet))


def _envoy_keys(config: RoutingConfig, pool: PoolConfig, admission: PoolAdmission) -> _EnvoyKeys:
    """The pool's runtime keys of each Envoy its admission names, where they differ from
    those of an Envoy not named (which the group's layer holds). Envoys with the same
    limits (and no split over lanes of their own) share one mapping."""
    clusters = names.band_clusters(config, pool)
    entries = [
        (band, lane, max_requests_key(cluster))
        for band in BANDS
        for lane, cluster in zip(config.lanes(pool), clusters[band], strict=True)
    ]
    floor = {key: admission.lane_limit(None, band, lane) for band, lane, key in entries}
    shared: dict[tuple[int, ...], Mapping[str, int]] = {}
    keys: dict[str, Mapping[str, int]] = {}
    for node_id, limits in admission.by_envoy.items():
        own: Mapping[str, int] | None
        if node_id in admission.by_lane:
            layer = {key: admission.lane_limit(node_id, band, lane) for band, lane, key in entries}
            own = {key: value for key, value in layer.items() if floor[key] != value}
        else:
            signature = tuple(limits[band] for band in BANDS)
            own = shared.get(signature)
            if own is None:
                own = shared[signature] = {
                    key: limits[band] for band, _, key in entries if floor[key] != limits[band]
                }
        if own:
            keys[node_id] = own
    for band, lanes in names.tenant_clusters(config, pool).items():
        split = admission.tenants.get(band)
        if split is not None:
            _add_tenant_keys(keys, lanes, split)
    return keys


def _add_tenant_keys(
    keys: dict[str, Mapping[str, int]], lanes: Mapping[str, str], split: TenantAdmission
) -> None:
    """Add to `keys` the runtime keys of one band's weighted tenants' lanes (`lanes`:
    tenant to cluster) where an Envoy's limit is not the floor: only the Envoys that use a
    lane hold more (admission._tenant_split)."""
    for node_id, limits in split.by_envoy.items():
        tenant_keys = {
            max_requests_key(lanes[tenant]): limit
            for tenant, limit in limits.items()
            if limit != split.floor[tenant]
        }
        if tenant_keys:
            keys[node_id] = {**keys.get(node_id, {}), **tenant_keys}
