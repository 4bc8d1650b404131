from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2

from xds_server.config import RoutingConfig
from xds_server.envoy import build_clusters, build_endpoints, names
from xds_server.envoy.clusters import LEAST_REQUEST_POLICY, ROUND_ROBIN_POLICY


def test_one_eds_cluster_per_pool(config: RoutingConfig) -> None:
    clusters = build_clusters(config)
    assert [c.name for c in clusters] == ["alpha", "beta", "empty"]
    for cluster, pool in zip(clusters, config.pools, strict=True):
        assert cluster.type == cluster_pb2.Cluster.EDS
        assert cluster.eds_cluster_config.service_name == names.eds_service_name(pool.name)
        assert cluster.eds_cluster_config.eds_config.HasField("ads")
        assert cluster.eds_cluster_config.eds_config.resource_api_version == 2  # V3
        assert cluster.connect_timeout.ToMilliseconds() == 500
        assert not cluster.HasField("load_assignment")


def test_weighted_least_request(config: RoutingConfig) -> None:
    for cluster in build_clusters(config):
        (policy,) = cluster.load_balancing_policy.policies
        assert policy.typed_extension_config.name == LEAST_REQUEST_POLICY
        assert policy.typed_extension_config.typed_config.Unpack(least_request_pb2.LeastRequest())
        # The legacy enum must stay unset so the typed policy is the one in force.
        assert cluster.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN
        assert not cluster.HasField("lb_subset_config")


def test_one_assignment_per_pool_with_weights(config: RoutingConfig) -> None:
    assignments = build_endpoints(config)
    assert [a.cluster_name for a in assignments] == ["alpha", "beta", "empty"]
    alpha = assignments[0]
    (locality,) = alpha.endpoints
    got = [
        (
            e.endpoint.address.socket_address.address,
            e.endpoint.address.socket_address.port_value,
            e.load_balancing_weight.value,
        )
        for e in locality.lb_endpoints
    ]
    assert got == [("10.0.0.1", 8000, 3), ("10.0.0.2", 8000, 1)]
    assert assignments[1].endpoints[0].lb_endpoints[0].load_balancing_weight.value == 7


def test_a_pool_without_endpoints_gets_an_empty_assignment(config: RoutingConfig) -> None:
    empty = build_endpoints(config)[2]
    assert empty.cluster_name == "empty"
    assert len(empty.endpoints) == 0


def test_assignments_are_deterministic(config: RoutingConfig) -> None:
    first = [a.SerializeToString(deterministic=True) for a in build_endpoints(config)]
    second = [a.SerializeToString(deterministic=True) for a in build_endpoints(config)]
    assert first == second


def test_round_robin_when_asked(config: RoutingConfig) -> None:
    pools = tuple(p.model_copy(update={"balancing": "round_robin"}) for p in config.pools)
    [cluster, *_] = build_clusters(config.model_copy(update={"pools": pools}))
    [policy] = cluster.load_balancing_policy.policies
    assert policy.typed_extension_config.name == ROUND_ROBIN_POLICY
    assert policy.typed_extension_config.typed_config.Unpack(round_robin_pb2.RoundRobin())
