"""The endpoints of every pool (ClusterLoadAssignments): who serves, how much, and what.

This is the resource the slow loop changes: weights and health from GPU metrics, and the
LoRA adapters each pod holds. Clusters, listeners and routes depend only on the routing
config, so a new decision is an EDS-only push (no connection churn).

A pool the policy decided on (present in `Decision.pools`) takes its endpoints from
there; any other pool takes them from the config, as written. Per endpoint:

- `load_balancing_weight`: the weight (weighted round robin and least request read it),
  or in a session assignment the ring weight, from capacity (consistent hashing sizes each
  host's share of the table by it, and a share that followed load would move keys), cut
  only for a pod that keeps spilling its keys (policy/homes.py).
- `health_status`: HEALTHY, DRAINING (finishes what it has, gets nothing new, and does not
  count against the pool's health) or UNHEALTHY (stale metrics: out of rotation). Config
  endpoints carry none (UNKNOWN), which Envoy treats as healthy. A pod that queues or
  prefills a long prompt (`spilling`) leaves the session assignment's rotation until it
  recovers, without moving any other pod's key. With `balancing.spill_to` "pool" (the
  default) it keeps its entry there, under its name and weight, so the Maglev table is
  the same, but its address is the pool's internal listener (names.spill_listener_name,
  the pod's name as `endpoint_id`), which passes its keys' requests on to the pool's
  cluster, balanced by load like unkeyed ones. With "ring" it is UNHEALTHY there: the
  table skips it and each of its keys goes to the next pod of the key's permutation,
  loaded or not. In the pool's assignment it is DEGRADED: Envoy sends a degraded host
  nothing while the healthy ones can take all the traffic, and the assignment's
  `overprovisioning_factor` (100 per endpoint: Envoy's 140 would send 30% of the traffic
  to the degraded half of a pool) says one healthy host can. A weight cut alone
  (`long_prompt_weight_factor`) left such a pod some picks, and in the benchmark's
  scenario b each chat it got waited seconds behind a document's prefill. When every
  healthy pod spills, none does (scoring.py); a LoRA subset whose holders are all
  degraded is served by them. While the pool's keys are suspended (affinity does not pay:
  policy/affinity.py) every healthy entry of the session assignment points at the spill
  listener, and the pool's own assignment is untouched.
- metadata `envoy.lb: {lora: [...]}` in a pool with adapters: the subset load balancer
  (clusters.py) puts the endpoint in the subset of each adapter listed. Only the pool's
  configured adapters are listed (no route could ask for another, and each value is a
  subset Envoy keeps), and only on HEALTHY endpoints: a subset whose hosts are all out of
  rotation is still "found", and Envoy answers 503 instead of falling back to the other
  endpoints, so a draining or stale holder must leave its subsets.
- metadata `envoy.lb: {key_bucket: [...], key_spare: true}` in the session assignment of a
  pool that keeps its keys in buckets (`balancing.key_homes` "buckets"): the buckets
  pinned to the pod or offered to it, and whether the keys of a bucket listed nowhere go
  to it (policy/buckets.py), on HEALTHY
  endpoints only, as the adapters; before any decision every pod takes new keys. Its
  priority 1 holds, for each such pod, a stand-in at the pool's spill listener with the
  same lists (`_add_bucket_fallbacks`).
- metadata `llm: {hardware: ...}` when known, for people reading /clusters.
- `hostname`: the endpoint's name (config.EndpointConfig.name: `namespace/name` on
  Kubernetes, else `address:port`). The session cluster's Maglev table hashes it
  (clusters.py), so where keys live depends on which pods serve, not on the IPs and ports
  they got: in the benchmark, whose simulated pods listen on ports the kernel picks,
  runs of one trace put the same keys together.

A pool with `remotes` (other clusters' gateways) gets them as a second priority: its own
pods stay at priority 0, the remotes' addresses go to priority 1 (HEALTHY when the
failover policy finds them usable, else UNHEALTHY; metadata
`envoy.transport_socket_match: {remote: name}` for one reached over TLS, clusters.py).
Envoy sends priority 1 what priority 0's health does not cover (its overprovisioning
factor times the healthy part), so with every local pod out of rotation, or ejected by
Envoy's outlier detection, all traffic goes to the remotes at once. The failover policy's
local share (policy/failover.py) steps the split in between: while it is below 1 the
assignment's overprovisioning factor is 100, its priority health is weighted
(`weighted_priority_health`), and priority 0 holds one more endpoint, never in rotation
(UNHEALTHY, `hostname` names.LOCAL_SHARE_HOST), whose weight makes the healthy local
weight exactly `share` of the priority's: Envoy then gives priority 0 that share and the
remotes the rest. At share 0 every local endpoint is UNHEALTHY instead.

Output is deterministic (endpoints sorted by address and port, adapters sorted), so the
content hash, which is the EDS version, changes only when the content does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any as _Any

from envoy.config.core.v3 import address_pb2, base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import struct_pb2, wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.config import EndpointConfig, PoolConfig, RoutingConfig
from xds_server.envoy import names
from xds_server.errors import ResourceBuildError
from xds_server.policy.decision import Decision
from xds_server.policy.failover import PoolFailover
from xds_server.policy.state import EndpointState, Health, PoolState

__all__ = ["HEALTH_STATUS", "build_endpoints", "build_pool_endpoints"]

# Envoy's own overprovisioning factor, in percent: a pool's assignment never gets less.
DEFAULT_OVERPROVISIONING = 140

# The EDS health statuses Envoy balances over (UNKNOWN: a config endpoint, taken as healthy).
_IN_ROTATION = (health_check_pb2.UNKNOWN, health_check_pb2.HEALTHY)

# The EDS health status of each policy verdict.
HEALTH_STATUS: Mapping[Health, int] = {
    Health.HEALTHY: health_check_pb2.HEALTHY,
    Health.DRAINING: health_check_pb2.DRAINING,
    Health.UNHEALTHY: health_check_pb2.UNHEALTHY,
}


def build_endpoints(config: RoutingConfig, decision: Decision | None = None) -> list[_Any]:
    """One ClusterLoadAssignment per pool, in config order, named names.eds_service_name,
    followed for a pool with session affinity by its session assignment
    (names.session_eds_service_name: ring weights, clusters.py).

    Pools in `decision.pools` take their endpoints from the decision; the others from `config`.
    Pools of the decision that the config does not have are ignored. A pool without endpoints
    gets an empty assignment (how EDS says "none": the cluster finishes warming and answers
    503 instead of waiting). Raises ResourceBuildError for a state that lists an endpoint twice or
    gives a weight below 1 (Envoy would refuse the whole assignment).
    """
    decided: Mapping[str, PoolState] = decision.pools if decision is not None else {}
    return [
        assignment
        for pool in config.pools
        for assignment in build_pool_endpoints(
            pool,
            decided.get(pool.name),
            spills=config.spills(pool),
            failover=decision.failover.get(pool.name) if decision is not None else None,
            buckets=config.bucket_homes(pool),
        )
    ]


def build_pool_endpoints(
    pool: PoolConfig,
    state: PoolState | None,
    *,
    spills: bool,
    failover: PoolFailover | None = None,
    buckets: bool = False,
) -> list[_Any]:
    """`pool`'s assignments (build_endpoints), from `state` when the policy decided on the
    pool, else from its config; `spills`: config.spills(pool); `failover`: its remotes and
    local share (None: no remotes); `buckets`: config.bucket_homes(pool). A pool's
    assignments depend on nothing else, so a change to one pool rebuilds only its own."""
    checked = _checked(pool.name, state.endpoints) if state is not None else []
    assignments = []
    for ring in (False, True) if pool.session_affinity else (False,):
        if state is None:
            lb_endpoints = [_from_config(pool, e, spare=ring and buckets) for e in pool.endpoints]
        else:
            spill_listener = names.spill_listener_name(pool.name) if ring and spills else None
            lb_endpoints = [
                _from_state(
                    pool,
                    e,
                    ring=ring,
                    spill_listener=spill_listener,
                    suspended=state.keys_suspended,
                    buckets=ring and buckets,
                )
                for e in checked
            ]
        assignment = endpoint_pb2.ClusterLoadAssignment(
            cluster_name=names.session_eds_service_name(pool.name)
            if ring
            else names.eds_service_name(pool.name)
        )
        if lb_endpoints:
            assignment.endpoints.append(
                endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb_endpoints)
            )
            if not ring:
                assignment.policy.overprovisioning_factor.value = max(
                    DEFAULT_OVERPROVISIONING, 100 * len(lb_endpoints)
                )
        if ring and buckets and state is not None:
            _add_bucket_fallbacks(assignment, pool, checked)
        if failover is not None and failover.targets:
            _add_remotes(assignment, failover)
        assignments.append(assignment)
    return assignments


def _add_bucket_fallbacks(
    assignment: _Any, pool: PoolConfig, endpoints: Iterable[EndpointState]
) -> None:
    """Priority 1 of a bucketed session assignment: for each pod that holds buckets or
    takes new keys, a stand-in at the pool's spill listener (`endpoint_id` the pod's name
    and names.KEY_FALLBACK_SUFFIX) listing the same. A bucket's subset keeps the
    priorities, so when its pod is out of rotation at an Envoy (ejected by its outlier
    detection) its keys are balanced over the pool, as Maglev's table sends them to the
    other pods, instead of a 503 (bench/results/bucket-homes/probe.py)."""
    fallbacks = endpoint_components_pb2.LocalityLbEndpoints(priority=1)
    listener = names.spill_listener_name(pool.name)
    for endpoint in endpoints:
        if endpoint.health is not Health.HEALTHY or not (
            endpoint.listed_buckets or endpoint.key_spare
        ):
            continue
        name = endpoint.ring_key + names.KEY_FALLBACK_SUFFIX
        lb_endpoint = endpoint_components_pb2.LbEndpoint(
            endpoint=endpoint_components_pb2.Endpoint(
                address=address_pb2.Address(
                    envoy_internal_address=address_pb2.EnvoyInternalAddress(
                        server_listener_name=listener, endpoint_id=name
                    )
                ),
                hostname=name,
            ),
            load_balancing_weight=wrappers_pb2.UInt32Value(
                value=endpoint.ring_weight if endpoint.ring_weight is not None else endpoint.weight
            ),
            health_status=health_check_pb2.HEALTHY,
        )
        lb_endpoint.metadata.filter_metadata[names.LB_METADATA_NAMESPACE].CopyFrom(
            _bucket_metadata(endpoint.listed_buckets, spare=endpoint.key_spare)
        )
        fallbacks.lb_endpoints.append(lb_endpoint)
    if fallbacks.lb_endpoints:
        assignment.endpoints.append(fallbacks)


def _add_remotes(assignment: _Any, failover: PoolFailover) -> None:
    """The remotes at priority 1, and the local share at priority 0 (module docstring)."""
    remote = endpoint_components_pb2.LocalityLbEndpoints(
        priority=1, locality=base_pb2.Locality(zone=names.REMOTE_ZONE)
    )
    for target in failover.targets:
        metadata = None
        if target.tls_match is not None:
            metadata = base_pb2.Metadata()
            metadata.filter_metadata[names.TRANSPORT_SOCKET_MATCH].update(
                {names.REMOTE_KEY: target.tls_match}
            )
        lb_endpoint = _lb_endpoint(
            target.address, target.port, target.weight, hostname=target.remote, metadata=metadata
        )
        lb_endpoint.health_status = HEALTH_STATUS[
            Health.HEALTHY if target.usable else Health.UNHEALTHY
        ]
        remote.lb_endpoints.append(lb_endpoint)
    if not failover.active or not assignment.endpoints:
        assignment.endpoints.append(remote)
        return
    local = assignment.endpoints[0]
    in_rotation = [e for e in local.lb_endpoints if e.health_status in _IN_ROTATION]
    if failover.share <= 0:
        for lb_endpoint in in_rotation:
            lb_endpoint.health_status = health_check_pb2.UNHEALTHY
            # Out of every adapter's subset too: a subset of hosts all out of rotation
            # answers 503 where the fallback (the whole pool, remotes included) serves.
            lb_endpoint.metadata.filter_metadata.pop(names.LB_METADATA_NAMESPACE, None)
    elif in_rotation:
        healthy = sum(e.load_balancing_weight.value for e in in_rotation)
        placeholder = _lb_endpoint(
            names.LOCAL_SHARE_ADDRESS,
            names.LOCAL_SHARE_PORT,
            max(1, round(healthy * (1 - failover.share) / failover.share)),
            hostname=names.LOCAL_SHARE_HOST,
            metadata=None,
        )
        placeholder.health_status = health_check_pb2.UNHEALTHY
        local.lb_endpoints.append(placeholder)
        assignment.policy.overprovisioning_factor.value = 100
        assignment.policy.weighted_priority_health = True
    assignment.endpoints.append(remote)


def _checked(pool: str, endpoints: Iterable[EndpointState]) -> list[EndpointState]:
    ordered = sorted(endpoints, key=lambda e: (e.address, e.port))
    for before, after in itertools.pairwise(ordered):
        if (before.address, before.port) == (after.address, after.port):
            raise ResourceBuildError(
                f"pool {pool!r}: endpoint {after.address}:{after.port} listed twice"
            )
    for endpoint in ordered:
        ring = endpoint.ring_weight if endpoint.ring_weight is not None else endpoint.weight
        weight = min(endpoint.weight, ring)
        if weight < 1:
            raise ResourceBuildError(
                f"pool {pool!r}: endpoint {endpoint.address}:{endpoint.port} has weight"
                f" {weight}; EDS weights start at 1"
            )
    return ordered


def _from_config(pool: PoolConfig, endpoint: EndpointConfig, *, spare: bool = False) -> _Any:
    """`endpoint` as configured; with `spare` (a bucketed session assignment before any
    decision) one of the pods new keys go to, as every pod is until keys are pinned."""
    lb_endpoint = _lb_endpoint(
        endpoint.address,
        endpoint.port,
        endpoint.weight,
        hostname=endpoint.ring_key,
        metadata=_metadata(pool, (), endpoint.hardware, buckets=() if spare else None, spare=spare),
    )
    if endpoint.draining:
        lb_endpoint.health_status = HEALTH_STATUS[Health.DRAINING]
    return lb_endpoint


def _from_state(
    pool: PoolConfig,
    endpoint: EndpointState,
    *,
    ring: bool,
    spill_listener: str | None,
    suspended: bool = False,
    buckets: bool = False,
) -> _Any:
    """`endpoint` in the pool's assignment, or with `ring` in its session assignment, where
    a spilling pod is sent to `spill_listener` (or, when None, out of rotation), and so is
    every pod while the pool's keys are `suspended` (when there is a listener to send
    them to); with `buckets`, listing its key buckets (and whether new keys go to it)
    while it is HEALTHY."""
    healthy = endpoint.health is Health.HEALTHY
    adapters = endpoint.adapters if healthy else ()
    weight = endpoint.weight
    if ring and endpoint.ring_weight is not None:
        weight = endpoint.ring_weight
    lb_endpoint = _lb_endpoint(
        endpoint.address,
        endpoint.port,
        weight,
        hostname=endpoint.ring_key,
        metadata=_metadata(
            pool,
            adapters,
            endpoint.hardware,
            buckets=endpoint.listed_buckets if buckets and healthy else None,
            spare=buckets and healthy and endpoint.key_spare,
        ),
    )
    lb_endpoint.health_status = HEALTH_STATUS[endpoint.health]
    if endpoint.health is not Health.HEALTHY:
        return lb_endpoint
    if endpoint.spilling and not ring:
        lb_endpoint.health_status = health_check_pb2.DEGRADED
    elif ring and (endpoint.spilling or (suspended and spill_listener is not None)):
        if spill_listener is None:
            lb_endpoint.health_status = HEALTH_STATUS[Health.UNHEALTHY]
        else:
            lb_endpoint.endpoint.address.CopyFrom(
                address_pb2.Address(
                    envoy_internal_address=address_pb2.EnvoyInternalAddress(
                        server_listener_name=spill_listener, endpoint_id=endpoint.ring_key
                    )
                )
            )
    return lb_endpoint


def _metadata(
    pool: PoolConfig,
    adapters: Iterable[str],
    hardware: str | None,
    *,
    buckets: tuple[int, ...] | None = None,
    spare: bool = False,
) -> _Any | None:
    """The endpoint's metadata: its adapters (a pool with any), its key buckets and
    whether new keys go to it (`buckets` not None: a bucketed session assignment), its
    hardware."""
    metadata = base_pb2.Metadata()
    if buckets is not None:
        metadata.filter_metadata[names.LB_METADATA_NAMESPACE].CopyFrom(
            _bucket_metadata(buckets, spare=spare)
        )
    if pool.adapters:
        held = sorted(set(adapters).intersection(pool.adapters))
        lb = struct_pb2.Struct()
        lb.get_or_create_list(names.LORA_KEY).extend(held)
        metadata.filter_metadata[names.LB_METADATA_NAMESPACE].CopyFrom(lb)
    if hardware is not None:
        metadata.filter_metadata[names.METADATA_NAMESPACE].update({names.HARDWARE_KEY: hardware})
    return metadata if metadata.filter_metadata else None


def _bucket_metadata(buckets: tuple[int, ...], *, spare: bool) -> _Any:
    """`envoy.lb` of a bucketed session entry: the buckets whose keys go to it, as strings
    (the listener writes a request's bucket as one), and KEY_SPARE_KEY when the keys of a
    bucket listed nowhere go to it."""
    lb = struct_pb2.Struct()
    lb.get_or_create_list(names.KEY_BUCKET_KEY).extend([str(b) for b in sorted(buckets)])
    if spare:
        lb.update({names.KEY_SPARE_KEY: True})
    return lb


def _lb_endpoint(
    address: str, port: int, weight: int, *, hostname: str, metadata: _Any | None
) -> _Any:
    lb_endpoint = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address=address, port_value=port)
            ),
            hostname=hostname,
        ),
        load_balancing_weight=wrappers_pb2.UInt32Value(value=weight),
    )
    if metadata is not None:
        lb_endpoint.metadata.CopyFrom(metadata)
    return lb_endpoint
