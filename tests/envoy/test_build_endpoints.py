"""ClusterLoadAssignments from the config, and from the policy's Decision."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.config.core.v3 import health_check_pb2
from google.protobuf import json_format

from xds_server.config import RoutingConfig
from xds_server.envoy import build_endpoints, names
from xds_server.errors import ResourceBuildError
from xds_server.policy.decision import Decision
from xds_server.policy.state import EndpointState, Health, PoolState


def _state(pool: str, *endpoints: EndpointState) -> Decision:
    return Decision(pools={pool: PoolState(name=pool, endpoints=endpoints)})


def _endpoints(assignment: Any) -> list[dict[str, Any]]:
    """Each endpoint as a plain dict: address, port, weight, health and metadata."""
    if not assignment.endpoints:
        return []
    (locality,) = assignment.endpoints
    return [
        {
            "address": e.endpoint.address.socket_address.address,
            "port": e.endpoint.address.socket_address.port_value,
            "weight": e.load_balancing_weight.value,
            "health": health_check_pb2.HealthStatus.Name(e.health_status),
            "metadata": json_format.MessageToDict(e.metadata).get("filterMetadata", {}),
        }
        for e in locality.lb_endpoints
    ]


def _by_pool(assignments: list[Any]) -> dict[str, Any]:
    return {a.cluster_name: a for a in assignments}


def test_without_state_the_config_endpoints_are_used(affinity_config: RoutingConfig) -> None:
    assert build_endpoints(affinity_config) == build_endpoints(affinity_config, Decision())
    llm = _by_pool(build_endpoints(affinity_config))["llm"]
    # Config order, health left UNKNOWN (healthy to Envoy); adapters unknown: empty lists.
    assert _endpoints(llm) == [
        {
            "address": "10.0.0.2",
            "port": 8000,
            "weight": 1,
            "health": "UNKNOWN",
            "metadata": {
                names.LB_METADATA_NAMESPACE: {names.LORA_KEY: []},
                names.METADATA_NAMESPACE: {names.HARDWARE_KEY: "h100"},
            },
        },
        {
            "address": "10.0.0.1",
            "port": 8000,
            "weight": 1,
            "health": "UNKNOWN",
            "metadata": {names.LB_METADATA_NAMESPACE: {names.LORA_KEY: []}},
        },
    ]


def test_a_pool_in_the_state_takes_its_endpoints_from_it(affinity_config: RoutingConfig) -> None:
    state = _state(
        "llm",
        EndpointState(address="10.0.0.9", port=8000, weight=700, adapters=("lora-b", "lora-a")),
        EndpointState(address="10.0.0.3", port=8001, weight=1000, hardware="a10g"),
        EndpointState(address="10.0.0.3", port=8000, weight=5, health=Health.DRAINING),
        EndpointState(address="10.0.0.4", port=8000, weight=1, health=Health.UNHEALTHY),
    )
    assignments = _by_pool(build_endpoints(affinity_config, state))
    lb = names.LB_METADATA_NAMESPACE
    assert _endpoints(assignments["llm"]) == [
        {
            "address": "10.0.0.3",
            "port": 8000,
            "weight": 5,
            "health": "DRAINING",
            "metadata": {lb: {names.LORA_KEY: []}},
        },
        {
            "address": "10.0.0.3",
            "port": 8001,
            "weight": 1000,
            "health": "HEALTHY",
            "metadata": {
                lb: {names.LORA_KEY: []},
                names.METADATA_NAMESPACE: {names.HARDWARE_KEY: "a10g"},
            },
        },
        {
            "address": "10.0.0.4",
            "port": 8000,
            "weight": 1,
            "health": "UNHEALTHY",
            "metadata": {lb: {names.LORA_KEY: []}},
        },
        {
            "address": "10.0.0.9",
            "port": 8000,
            "weight": 700,
            "health": "HEALTHY",
            "metadata": {lb: {names.LORA_KEY: ["lora-a", "lora-b"]}},
        },
    ]
    # The session assignment: the same endpoints, health and adapters on ring weights
    # (capacity alone, when the policy gives them; else the weight itself).
    ring = _endpoints(assignments["llm/session"])
    assert [e["weight"] for e in ring] == [5, 1000, 1, 700]
    assert [{**e, "weight": 0} for e in ring] == [
        {**e, "weight": 0} for e in _endpoints(assignments["llm"])
    ]
    steady = _state(
        "llm",
        EndpointState(address="10.0.0.9", port=8000, weight=700, ring_weight=100_000),
        EndpointState(address="10.0.0.3", port=8001, weight=1000, ring_weight=100_000),
    )
    by_pool = _by_pool(build_endpoints(affinity_config, steady))
    assert [e["weight"] for e in _endpoints(by_pool["llm"])] == [1000, 700]
    assert [e["weight"] for e in _endpoints(by_pool["llm/session"])] == [100_000, 100_000]
    # Pools absent from the state keep their config endpoints.
    assert _endpoints(assignments["plain"]) == [
        {"address": "10.0.1.1", "port": 9000, "weight": 1, "health": "UNKNOWN", "metadata": {}}
    ]
    assert not assignments["rr"].endpoints


def test_only_healthy_endpoints_list_adapters(affinity_config: RoutingConfig) -> None:
    # A subset whose hosts are all out of rotation is still "found", and Envoy answers 503
    # instead of falling back: a draining or stale holder must leave its subsets.
    for health in (Health.DRAINING, Health.UNHEALTHY):
        state = _state(
            "llm",
            EndpointState(
                address="10.0.0.1", port=1, weight=1, health=health, adapters=("lora-a",)
            ),
        )
        (endpoint,) = _endpoints(_by_pool(build_endpoints(affinity_config, state))["llm"])
        assert endpoint["metadata"][names.LB_METADATA_NAMESPACE] == {names.LORA_KEY: []}


def test_only_configured_adapters_are_listed(affinity_config: RoutingConfig) -> None:
    state = _state(
        "llm", EndpointState(address="10.0.0.1", port=1, weight=1, adapters=("other", "lora-b"))
    )
    (endpoint,) = _endpoints(_by_pool(build_endpoints(affinity_config, state))["llm"])
    assert endpoint["metadata"][names.LB_METADATA_NAMESPACE] == {names.LORA_KEY: ["lora-b"]}


def test_a_pool_without_adapters_has_no_lora_metadata(affinity_config: RoutingConfig) -> None:
    state = _state("plain", EndpointState(address="10.0.1.1", port=9000, weight=3, adapters=("x",)))
    (endpoint,) = _endpoints(_by_pool(build_endpoints(affinity_config, state))["plain"])
    assert endpoint["metadata"] == {}
    assert (endpoint["weight"], endpoint["health"]) == (3, "HEALTHY")


def test_an_empty_pool_state_is_an_empty_assignment(affinity_config: RoutingConfig) -> None:
    llm = _by_pool(build_endpoints(affinity_config, _state("llm")))["llm"]
    assert llm.cluster_name == "llm"
    assert len(llm.endpoints) == 0


def test_state_pools_the_config_lacks_are_ignored(affinity_config: RoutingConfig) -> None:
    state = _state("gone", EndpointState(address="10.9.9.9", port=1, weight=1))
    assert build_endpoints(affinity_config, state) == build_endpoints(affinity_config)


def test_output_does_not_depend_on_the_state_order(affinity_config: RoutingConfig) -> None:
    endpoints = [
        EndpointState(address=f"10.0.0.{i}", port=8000 + i % 2, weight=i, adapters=("lora-a",))
        for i in range(1, 9)
    ]
    forward = build_endpoints(affinity_config, _state("llm", *endpoints))
    backward = build_endpoints(affinity_config, _state("llm", *reversed(endpoints)))
    assert [a.SerializeToString(deterministic=True) for a in forward] == [
        a.SerializeToString(deterministic=True) for a in backward
    ]


def test_an_endpoint_listed_twice_is_refused(affinity_config: RoutingConfig) -> None:
    twice = EndpointState(address="10.0.0.1", port=8000, weight=1)
    with pytest.raises(ResourceBuildError, match=r"10\.0\.0\.1:8000 listed twice"):
        build_endpoints(affinity_config, _state("llm", twice, twice))


def test_a_weight_below_one_is_refused(affinity_config: RoutingConfig) -> None:
    zero = EndpointState(address="10.0.0.1", port=8000, weight=0)
    with pytest.raises(ResourceBuildError, match="weight 0"):
        build_endpoints(affinity_config, _state("llm", zero))
    no_ring = EndpointState(address="10.0.0.1", port=8000, weight=5, ring_weight=0)
    with pytest.raises(ResourceBuildError, match="weight 0"):
        build_endpoints(affinity_config, _state("llm", no_ring))


def test_a_draining_config_endpoint_is_draining(affinity_config: RoutingConfig) -> None:
    plain = affinity_config.pools[2]
    drained = plain.model_copy(
        update={"endpoints": (plain.endpoints[0].model_copy(update={"draining": True}),)}
    )
    config = affinity_config.model_copy(update={"pools": (*affinity_config.pools[:2], drained)})
    (endpoint,) = _endpoints(_by_pool(build_endpoints(config))["plain"])
    assert endpoint["health"] == "DRAINING"


def _spilling_state() -> Decision:
    return _state(
        "llm",
        EndpointState(address="10.0.0.3", port=8001, weight=10, ring_weight=100_000, spilling=True),
        EndpointState(
            address="10.0.0.4",
            port=8001,
            weight=10,
            ring_weight=100_000,
            spilling=True,
            health=Health.DRAINING,
        ),
        EndpointState(address="10.0.0.9", port=8000, weight=900, ring_weight=100_000),
    )


def test_a_spilling_pod_is_degraded_in_the_pool_and_the_spill_listener_on_the_ring(
    affinity_config: RoutingConfig,
) -> None:
    """A pod that queues or prefills a long prompt is DEGRADED in the pool's assignment
    (nothing new while a healthy pod can take it all: the overprovisioning factor says one
    can). In the session assignment it keeps its name and ring weight, so the Maglev table
    does not change, but its address is the pool's spill listener: its keys' requests are
    balanced over the pool until it recovers. Only a HEALTHY pod is marked: a draining one
    stays draining, at its own address."""
    by_pool = _by_pool(build_endpoints(affinity_config, _spilling_state()))
    assert [e["health"] for e in _endpoints(by_pool["llm"])] == [
        "DEGRADED",
        "DRAINING",
        "HEALTHY",
    ]
    ring = by_pool["llm/session"].endpoints[0].lb_endpoints
    assert [health_check_pb2.HealthStatus.Name(e.health_status) for e in ring] == [
        "HEALTHY",
        "DRAINING",
        "HEALTHY",
    ]
    spilled = ring[0]
    assert spilled.endpoint.hostname == "10.0.0.3:8001"
    assert spilled.load_balancing_weight.value == 100_000
    internal = spilled.endpoint.address.envoy_internal_address
    assert (internal.server_listener_name, internal.endpoint_id) == ("llm/spill", "10.0.0.3:8001")
    assert [e.endpoint.address.WhichOneof("address") for e in ring[1:]] == ["socket_address"] * 2
    # Envoy's health of a priority: min(100, factor * healthy hosts / hosts): 100 with one.
    assert by_pool["llm"].policy.overprovisioning_factor.value == 300
    assert not by_pool["llm/session"].HasField("policy")


def test_with_spill_to_ring_a_spilling_pod_leaves_the_ring(
    affinity_config: RoutingConfig,
) -> None:
    """`spill_to: ring`: the pod is UNHEALTHY in the session assignment, so the Maglev table
    skips it and each of its keys goes to the next pod of its permutation."""
    config = affinity_config.model_copy(
        update={"balancing": affinity_config.balancing.model_copy(update={"spill_to": "ring"})}
    )
    by_pool = _by_pool(build_endpoints(config, _spilling_state()))
    assert [e["health"] for e in _endpoints(by_pool["llm/session"])] == [
        "UNHEALTHY",
        "DRAINING",
        "HEALTHY",
    ]
    assert _endpoints(by_pool["llm/session"])[0]["address"] == "10.0.0.3"
    assert [e["health"] for e in _endpoints(by_pool["llm"])] == [
        "DEGRADED",
        "DRAINING",
        "HEALTHY",
    ]


def test_endpoints_carry_their_names_as_hostnames(affinity_config: RoutingConfig) -> None:
    """The session ring hashes hostnames: a named endpoint's name, else `address:port`."""

    def hostnames(assignments: list[Any]) -> dict[str, list[str]]:
        return {
            a.cluster_name: [e.endpoint.hostname for e in a.endpoints[0].lb_endpoints]
            for a in assignments
        }

    named = affinity_config.model_copy(
        update={
            "pools": (
                affinity_config.pools[0].model_copy(
                    update={
                        "endpoints": tuple(
                            e.model_copy(update={"name": f"ml/pod-{i}"} if i == 0 else {})
                            for i, e in enumerate(affinity_config.pools[0].endpoints)
                        )
                    }
                ),
            )
        }
    )
    from_config = hostnames(build_endpoints(named))
    assert from_config["llm"] == from_config["llm/session"] == ["ml/pod-0", "10.0.0.1:8000"]

    state = _state(
        "llm",
        EndpointState(address="10.0.0.7", port=8000, weight=5, name="ml/pod-7"),
        EndpointState(address="10.0.0.3", port=8000, weight=5),
    )
    from_state = hostnames(build_endpoints(named, state))
    assert from_state["llm"] == from_state["llm/session"] == ["10.0.0.3:8000", "ml/pod-7"]
