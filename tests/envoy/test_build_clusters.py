from __future__ import annotations

from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.maglev.v3 import maglev_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.extensions.load_balancing_policies.subset.v3 import subset_pb2

from xds_server.config import BalancingConfig, RoutingConfig, parse_config
from xds_server.envoy import (
    build_cluster,
    build_clusters,
    build_endpoints,
    build_session_cluster,
    names,
)
from xds_server.envoy.clusters import (
    LEAST_REQUEST_POLICY,
    MAGLEV_POLICY,
    ROUND_ROBIN_POLICY,
    SUBSET_POLICY,
)
from xds_server.maglev import RING_SPILL_TABLE_SIZE, table_size
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot


def test_one_eds_cluster_per_pool_and_one_for_its_long_prompts(config: RoutingConfig) -> None:
    clusters = build_clusters(config)
    assert [c.name for c in clusters] == [
        "alpha",
        "alpha/long",
        "beta",
        "beta/long",
        "empty",
        "empty/long",
    ]
    for cluster, pool in zip(clusters[::2], config.pools, strict=True):
        assert cluster.type == cluster_pb2.Cluster.EDS
        assert cluster.eds_cluster_config.service_name == names.eds_service_name(pool.name)
        assert cluster.eds_cluster_config.eds_config.HasField("ads")
        assert cluster.eds_cluster_config.eds_config.resource_api_version == 2  # V3
        assert cluster.connect_timeout.ToMilliseconds() == 500
        assert not cluster.HasField("load_assignment")
    # The long-prompt cluster is the pool's own under another name: same assignment and
    # balancing, counted apart in the load reports.
    for cluster, long_prompts in zip(clusters[::2], clusters[1::2], strict=True):
        renamed = cluster_pb2.Cluster()
        renamed.CopyFrom(long_prompts)
        renamed.name = cluster.name
        assert renamed == cluster


def test_no_long_prompt_cluster_when_turned_off_or_without_gpu_aware_weights(
    affinity_config: RoutingConfig,
) -> None:
    # `rr` balances by round robin, so no metrics weights: no lane for long prompts.
    assert "rr/long" not in {c.name for c in build_clusters(affinity_config)}
    balancing = affinity_config.balancing.model_copy(update={"long_prompt_bytes": 0})
    off = affinity_config.model_copy(update={"balancing": balancing})
    assert [c.name for c in build_clusters(off)] == ["llm", "llm/session", "rr", "plain"]


def test_gpu_aware_pools_default_to_weighted_round_robin(config: RoutingConfig) -> None:
    # balancing.active_request_bias 0 (the default): the policy's weights alone.
    for cluster in build_clusters(config):
        assert _policy_of(cluster).name == ROUND_ROBIN_POLICY


def test_weighted_least_request(config: RoutingConfig) -> None:
    for cluster in build_clusters(_with_bias(config, 1.0)):
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


def _policy_of(cluster: Any) -> Any:
    (policy,) = cluster.load_balancing_policy.policies
    return policy.typed_extension_config


def _subset_of(cluster: Any) -> tuple[Any, Any]:
    """The subset balancer's config and its child policy (a TypedExtensionConfig)."""
    policy = _policy_of(cluster)
    assert policy.name == SUBSET_POLICY
    subset = subset_pb2.Subset()
    assert policy.typed_config.Unpack(subset)
    (child,) = subset.subset_lb_policy.policies
    return subset, child.typed_extension_config


def test_panic_mode_is_off_on_every_cluster(affinity_config: RoutingConfig) -> None:
    # Envoy's default (50%) would spread traffic over unhealthy hosts when most are.
    for cluster in [*build_clusters(affinity_config), *build_clusters(_plain())]:
        assert cluster.common_lb_config.HasField("healthy_panic_threshold"), cluster.name
        assert cluster.common_lb_config.healthy_panic_threshold.value == 0.0


# The clusters of AFFINITY_YAML in order: `rr` balances by round robin, so it has no
# metrics weights and no long-prompt lane.
AFFINITY_CLUSTERS = ["llm", "llm/session", "llm/long", "rr", "plain", "plain/long"]


def test_clusters_in_pool_order_with_session_clusters(affinity_config: RoutingConfig) -> None:
    clusters = build_clusters(affinity_config)
    assert [c.name for c in clusters] == AFFINITY_CLUSTERS
    # The session cluster has its own assignment: ring weights follow capacity, not load.
    assert [c.eds_cluster_config.service_name for c in clusters] == [
        "llm",
        "llm/session",
        "llm",
        "rr",
        "plain",
        "plain",
    ]
    assert names.session_cluster_name("llm") == "llm/session"


def test_a_pool_with_adapters_balances_within_subsets(affinity_config: RoutingConfig) -> None:
    by_name = {c.name: c for c in build_clusters(_with_bias(affinity_config, 1.0))}
    for pool, child_name in [("llm", LEAST_REQUEST_POLICY), ("rr", ROUND_ROBIN_POLICY)]:
        subset, child = _subset_of(by_name[pool])
        (selector,) = subset.subset_selectors
        assert list(selector.keys) == [names.LORA_KEY]
        assert subset.list_as_any
        assert subset.fallback_policy == subset_pb2.Subset.ANY_ENDPOINT
        assert child.name == child_name
    # A pool without adapters keeps the plain policy.
    assert _policy_of(by_name["plain"]).name == LEAST_REQUEST_POLICY


def test_the_session_cluster_hashes_with_bounded_load(affinity_config: RoutingConfig) -> None:
    pool = affinity_config.pools[0]
    session = build_session_cluster(affinity_config, pool)
    assert session.name == "llm/session"
    assert session.type == cluster_pb2.Cluster.EDS
    assert session.eds_cluster_config.service_name == "llm/session"
    assert session.connect_timeout == build_cluster(affinity_config, pool).connect_timeout
    # The pool has adapters, so the ring sits inside the subset balancer too.
    _, child = _subset_of(session)
    assert child.name == MAGLEV_POLICY
    ring = maglev_pb2.Maglev()
    assert child.typed_config.Unpack(ring)
    assert ring.consistent_hashing_lb_config.hash_balance_factor.value == 175
    # Keys are placed by endpoint names (their hostnames), not by addresses.
    assert ring.consistent_hashing_lb_config.use_hostname_for_hashing
    # Without adapters: the ring itself.
    no_adapters = pool.model_copy(update={"adapters": ()})
    policy = _policy_of(build_session_cluster(affinity_config, no_adapters))
    assert policy.name == MAGLEV_POLICY
    assert policy.typed_config.Unpack(ring)
    assert ring.consistent_hashing_lb_config.hash_balance_factor.value == 175
    # The table the server builds too (maglev.table_size); with `spill_to: ring`, where a
    # spilling pod leaves it, Envoy's own size, which moves fewer of the other pods' keys.
    assert ring.table_size.value == table_size(len(pool.endpoints))
    ring_spill = affinity_config.model_copy(
        update={"balancing": affinity_config.balancing.model_copy(update={"spill_to": "ring"})}
    )
    policy = _policy_of(build_session_cluster(ring_spill, no_adapters))
    assert policy.typed_config.Unpack(ring)
    assert ring.table_size.value == RING_SPILL_TABLE_SIZE


def test_bounded_load_is_off_unless_set(affinity_config: RoutingConfig) -> None:
    # Unset, Envoy's bounded load is off: it read a pod against the others, not its own
    # room, and moved keys off pods with room (scenario c; bench/results/bounded-load).
    balancing = affinity_config.balancing.model_copy(update={"hash_balance_factor": None})
    unset = affinity_config.model_copy(update={"balancing": balancing})
    pool = unset.pools[0].model_copy(update={"adapters": ()})
    ring = maglev_pb2.Maglev()
    assert _policy_of(build_session_cluster(unset, pool)).typed_config.Unpack(ring)
    assert not ring.consistent_hashing_lb_config.HasField("hash_balance_factor")
    assert ring.consistent_hashing_lb_config.use_hostname_for_hashing
    assert BalancingConfig().hash_balance_factor is None


def test_every_cluster_has_its_assignment(affinity_config: RoutingConfig) -> None:
    # The xDS snapshot refuses a cluster whose ClusterLoadAssignment is missing.
    snapshot = Snapshot.build(
        {
            ResourceType.CLUSTER: build_clusters(affinity_config),
            ResourceType.ENDPOINT: build_endpoints(affinity_config),
        }
    )
    assert snapshot.names(ResourceType.CLUSTER) == set(AFFINITY_CLUSTERS)
    assert snapshot.names(ResourceType.ENDPOINT) == {"llm", "llm/session", "rr", "plain"}


def _plain() -> RoutingConfig:
    return RoutingConfig.model_validate({"pools": [{"name": "p", "models": ["m"]}]})


def _with_bias(config: RoutingConfig, bias: float) -> RoutingConfig:
    balancing = config.balancing.model_copy(update={"active_request_bias": bias})
    return config.model_copy(update={"balancing": balancing})


def test_active_request_bias_reaches_least_request(config: RoutingConfig) -> None:
    alpha, *_ = build_clusters(_with_bias(config, 0.5))
    policy = _policy_of(alpha)
    assert policy.name == LEAST_REQUEST_POLICY
    least_request = least_request_pb2.LeastRequest()
    assert policy.typed_config.Unpack(least_request)
    assert least_request.active_request_bias.default_value == 0.5
    assert least_request.active_request_bias.runtime_key == (
        "upstream.alpha.least_request.active_request_bias"
    )
    # A bias of 1 leaves Envoy's own default in place.
    default = least_request_pb2.LeastRequest()
    assert _policy_of(build_clusters(_with_bias(config, 1.0))[0]).typed_config.Unpack(default)
    assert not default.HasField("active_request_bias")


def test_bias_zero_is_weighted_round_robin_for_gpu_aware_pools_only(
    config: RoutingConfig,
) -> None:
    pools = (config.pools[0].model_copy(update={"gpu_aware": False}), *config.pools[1:])
    static, gpu_aware, *_ = build_clusters(
        _with_bias(config, 0).model_copy(update={"pools": pools})
    )
    # Weights alone: round robin, which Envoy weights by EDF when weights differ.
    assert _policy_of(gpu_aware).name == ROUND_ROBIN_POLICY
    # A pool with static weights keeps Envoy's least request as configured.
    assert _policy_of(static).name == LEAST_REQUEST_POLICY


def test_bias_applies_inside_the_subset_balancer(affinity_config: RoutingConfig) -> None:
    for cluster in build_clusters(_with_bias(affinity_config, 0)):
        policy = _policy_of(cluster)
        if policy.name == SUBSET_POLICY:
            _, child = _subset_of(cluster)
            assert child.name in (ROUND_ROBIN_POLICY, MAGLEV_POLICY)


def _with_flow_control(config: RoutingConfig) -> RoutingConfig:
    flow = config.flow_control.model_copy(update={"enabled": True})
    return config.model_copy(update={"flow_control": flow})


def test_flow_control_adds_band_clusters_copying_the_pools_clusters(
    affinity_config: RoutingConfig,
) -> None:
    plain = {c.name: c for c in build_clusters(affinity_config)}
    banded = {c.name: c for c in build_clusters(_with_flow_control(affinity_config))}
    bands = ("critical", "standard", "sheddable")
    expected = {
        **{name: name for name in plain},
        **{names.band_cluster_name(p, b): p for p in ("llm", "rr", "plain") for b in bands},
        **{names.band_cluster_name("llm", b, "session"): "llm/session" for b in bands},
        **{
            names.band_cluster_name(p, b, "long"): f"{p}/long"
            for p in ("llm", "plain")
            for b in bands
        },
    }
    assert set(banded) == set(expected)
    for name, base in expected.items():
        cluster = cluster_pb2.Cluster()
        cluster.CopyFrom(banded[name])
        if name != base:
            (threshold,) = cluster.circuit_breakers.thresholds
            assert threshold.priority == 0  # DEFAULT
            assert threshold.max_requests.value == 1_000_000
            assert threshold.max_pending_requests.value == 1_000_000
            assert threshold.max_connections.value == 1_000_000
            assert threshold.track_remaining
            # The same retry budget as the pool's own clusters.
            (own,) = plain[base].circuit_breakers.thresholds
            assert threshold.retry_budget == own.retry_budget
            cluster.ClearField("circuit_breakers")
            cluster.name = base
        else:
            cluster.ClearField("circuit_breakers")
        # Same policy, subsets, EDS service name, ejection and upstream settings as the
        # pool's own.
        expected_base = cluster_pb2.Cluster()
        expected_base.CopyFrom(plain[base])
        expected_base.ClearField("circuit_breakers")
        assert cluster == expected_base, name


def test_band_cluster_names() -> None:
    assert names.band_cluster_name("llama", "sheddable") == "llama/sheddable"
    assert names.band_cluster_name("llama", "critical", "session") == "llama/session/critical"
    assert names.band_cluster_name("llama", "standard", "long") == "llama/long/standard"
    assert names.lane_cluster_name("llama", "long") == "llama/long"


def test_pool_clusters_set_limits_retry_budget_and_ejection_from_config() -> None:
    config = parse_config(
        """
        upstream: {max_requests: 500, retry_budget_percent: 25, eject_after_failures: 2,
                   max_ejection_percent: 40}
        pools: [{name: p, models: [m], session_affinity: true}]
        """
    )
    for cluster in build_clusters(config):
        (threshold,) = cluster.circuit_breakers.thresholds
        assert threshold.max_requests.value == 500  # not Envoy's built-in 1,024
        assert threshold.retry_budget.budget_percent.value == 25
        assert threshold.retry_budget.min_retry_concurrency.value == 16
        outliers = cluster.outlier_detection
        assert outliers.split_external_local_origin_errors
        assert outliers.consecutive_local_origin_failure.value == 2
        assert outliers.enforcing_consecutive_local_origin_failure.value == 100
        # HTTP 5xx answers never eject: a bad request can cause one on a healthy pod.
        assert outliers.enforcing_consecutive_5xx.value == 0
        assert outliers.max_ejection_percent.value == 40
