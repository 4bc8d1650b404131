"""Key buckets (`balancing.key_homes: buckets`) in the resources: the listener's filter
that writes a request's bucket, the session cluster's subsets, the session assignment's
lists and its priority-1 stand-ins. tests/e2e/test_key_buckets.py checks them through a
real Envoy."""

from __future__ import annotations

from typing import Any

import xxhash
from envoy.extensions.common.matching.v3 import extension_matcher_pb2
from envoy.extensions.filters.http.composite.v3 import composite_pb2
from envoy.extensions.filters.http.set_metadata.v3 import set_metadata_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.subset.v3 import subset_pb2
from envoy.extensions.matching.input_matchers.consistent_hashing.v3 import (
    consistent_hashing_pb2,
)
from google.protobuf import json_format

from xds_server.config import RoutingConfig, parse_config
from xds_server.envoy import build_clusters, build_endpoints, build_listeners, names
from xds_server.envoy._key_buckets import KEY_BUCKET_FILTER
from xds_server.policy.decision import Decision
from xds_server.policy.state import EndpointState, Health, PoolState

CONFIG = """
balancing: {key_homes: buckets, key_buckets: 16}
pools:
  - name: chat
    models: [m]
    session_affinity: true
    endpoints:
      - {address: 10.0.0.1, port: 8000, name: ns/a}
      - {address: 10.0.0.2, port: 8000, name: ns/b}
      - {address: 10.0.0.3, port: 8000, name: ns/c}
  - name: lora
    models: [base]
    adapters: [x]
    session_affinity: true
    endpoints: [{address: 10.0.1.1, port: 8000}]
"""


def _config(text: str = CONFIG) -> RoutingConfig:
    return parse_config(text)


def _filters(config: RoutingConfig) -> list[Any]:
    main = build_listeners(config)[0]
    hcm = hcm_pb2.HttpConnectionManager()
    main.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return list(hcm.http_filters)


def _bucket_of(tree: Any, key: str, buckets: int) -> int | None:
    """Walk the filter's matcher tree as Envoy does, for a request whose session header is
    `key` (None: no header), to the bucket its leaf writes (None: no action)."""
    hashed = None if key is None else xxhash.xxh64_intdigest(key.encode(), seed=0) % buckets
    matcher = tree
    while True:
        (field,) = matcher.matcher_list.matchers
        at_least = consistent_hashing_pb2.ConsistentHashing()
        field.predicate.single_predicate.custom_match.typed_config.Unpack(at_least)
        assert at_least.modulo == buckets and at_least.seed == 0
        if hashed is not None and hashed >= at_least.threshold:
            on = field.on_match
        elif matcher.HasField("on_no_match"):
            on = matcher.on_no_match
        else:
            return None
        if on.HasField("matcher"):
            matcher = on.matcher
            continue
        action = composite_pb2.ExecuteFilterAction()
        on.action.typed_config.Unpack(action)
        written = set_metadata_pb2.Config()
        action.typed_config.typed_config.Unpack(written)
        (metadata,) = written.metadata
        assert metadata.metadata_namespace == names.LB_METADATA_NAMESPACE
        return int(metadata.value[names.KEY_BUCKET_KEY])


def test_the_listener_writes_each_keyed_requests_bucket_before_the_router() -> None:
    config = _config()
    filters = _filters(config)
    order = [f.name for f in filters]
    assert order.index(KEY_BUCKET_FILTER) == order.index("envoy.filters.http.router") - 1
    with_matcher = extension_matcher_pb2.ExtensionWithMatcher()
    filters[order.index(KEY_BUCKET_FILTER)].typed_config.Unpack(with_matcher)
    tree = with_matcher.xds_matcher
    for n in range(200):
        key = f"session-{n}"
        expected = xxhash.xxh64_intdigest(key.encode(), seed=0) % 16
        assert _bucket_of(tree, key, 16) == expected
    assert _bucket_of(tree, None, 16) is None  # type: ignore[arg-type]


def test_no_filter_without_a_bucketed_pool() -> None:
    plain = _config(CONFIG.replace("key_homes: buckets", "key_homes: hash"))
    assert KEY_BUCKET_FILTER not in [f.name for f in _filters(plain)]


def _policy(cluster: Any) -> Any:
    (policy,) = cluster.load_balancing_policy.policies
    return policy.typed_extension_config


def test_the_session_cluster_picks_by_bucket_and_sends_new_keys_to_the_spares() -> None:
    clusters = {c.name: c for c in build_clusters(_config())}
    subset = subset_pb2.Subset()
    _policy(clusters["chat/session"]).typed_config.Unpack(subset)
    assert [list(s.keys) for s in subset.subset_selectors] == [[names.KEY_BUCKET_KEY]]
    assert subset.list_as_any
    assert subset.fallback_policy == subset_pb2.Subset.DEFAULT_SUBSET
    assert dict(subset.default_subset) == {names.KEY_SPARE_KEY: True}
    # Least request inside: it honours the retries' previous_priorities (a hashing
    # balancer would draw a dead pod again). It scans every pod of a subset: new keys that
    # arrive together go to the spares with the fewest in flight, not two random ones.
    (child,) = subset.subset_lb_policy.policies
    assert child.typed_extension_config.name == "envoy.load_balancing_policies.least_request"
    least_request = least_request_pb2.LeastRequest()
    assert child.typed_extension_config.typed_config.Unpack(least_request)
    assert least_request.selection_method == least_request_pb2.LeastRequest.FULL_SCAN
    # The pool's own cluster is not bucketed.
    assert _policy(clusters["chat"]).name != "envoy.load_balancing_policies.subset"


def test_adapter_subsets_fall_back_from_a_keyed_requests_bucket() -> None:
    """A keyed request's bucket joins the route's `lora`: the adapter pool's clusters
    need a selector that falls back to `[lora]`."""
    clusters = {c.name: c for c in build_clusters(_config())}
    for name in ("lora", "lora/session"):
        subset = subset_pb2.Subset()
        _policy(clusters[name]).typed_config.Unpack(subset)
        selectors = {tuple(s.keys): s for s in subset.subset_selectors}
        both = selectors[(names.KEY_BUCKET_KEY, names.LORA_KEY)]
        assert both.fallback_policy == subset_pb2.Subset.LbSubsetSelector.KEYS_SUBSET
        assert list(both.fallback_keys_subset) == [names.LORA_KEY]
    plain = _config(CONFIG.replace("key_homes: buckets", "key_homes: hash"))
    subset = subset_pb2.Subset()
    _policy({c.name: c for c in build_clusters(plain)}["lora"]).typed_config.Unpack(subset)
    assert [list(s.keys) for s in subset.subset_selectors] == [[names.LORA_KEY]]


def _session_assignment(config: RoutingConfig, decision: Decision | None = None) -> Any:
    return {a.cluster_name: a for a in build_endpoints(config, decision)}[
        names.session_eds_service_name("chat")
    ]


def _lb(lb_endpoint: Any) -> dict[str, Any]:
    metadata = json_format.MessageToDict(lb_endpoint.metadata).get("filterMetadata", {})
    return dict(metadata.get(names.LB_METADATA_NAMESPACE, {}))


def test_before_any_decision_every_pod_takes_new_keys() -> None:
    assignment = _session_assignment(_config())
    (local,) = assignment.endpoints
    assert [_lb(e) for e in local.lb_endpoints] == [
        {names.KEY_BUCKET_KEY: [], names.KEY_SPARE_KEY: True}
    ] * 3


def test_each_healthy_pod_lists_its_buckets_with_a_stand_in_at_priority_1() -> None:
    endpoints = (
        EndpointState(address="10.0.0.1", port=8000, name="ns/a", weight=9, ring_weight=100,
                      key_buckets=(3, 11), key_spare=False),
        EndpointState(address="10.0.0.2", port=8000, name="ns/b", weight=9, ring_weight=100,
                      key_buckets=(5,), key_spare=True, spilling=True),
        EndpointState(address="10.0.0.3", port=8000, name="ns/c", weight=9, ring_weight=100,
                      key_buckets=(7,), key_spare=True, health=Health.UNHEALTHY),
    )  # fmt: skip
    decision = Decision(pools={"chat": PoolState(name="chat", endpoints=endpoints)})
    local, fallback = _session_assignment(_config(), decision).endpoints
    assert [_lb(e) for e in local.lb_endpoints] == [
        {names.KEY_BUCKET_KEY: ["3", "11"]},
        {names.KEY_BUCKET_KEY: ["5"], names.KEY_SPARE_KEY: True},
        {},  # out of rotation: in no subset
    ]
    # A spilling pod keeps its buckets; its entry points at the spill listener.
    assert local.lb_endpoints[1].endpoint.address.envoy_internal_address.endpoint_id == "ns/b"
    assert fallback.priority == 1
    stand_ins = {
        e.endpoint.address.envoy_internal_address.endpoint_id: (
            e.endpoint.address.envoy_internal_address.server_listener_name,
            _lb(e),
        )
        for e in fallback.lb_endpoints
    }
    listener = names.spill_listener_name("chat")
    assert stand_ins == {
        "ns/a" + names.KEY_FALLBACK_SUFFIX: (listener, {names.KEY_BUCKET_KEY: ["3", "11"]}),
        "ns/b" + names.KEY_FALLBACK_SUFFIX: (
            listener,
            {names.KEY_BUCKET_KEY: ["5"], names.KEY_SPARE_KEY: True},
        ),
    }


def test_the_pools_own_assignment_lists_no_bucket() -> None:
    endpoints = (
        EndpointState(address="10.0.0.1", port=8000, name="ns/a", weight=9, ring_weight=100,
                      key_buckets=(3,), key_spare=True),
    )  # fmt: skip
    decision = Decision(pools={"chat": PoolState(name="chat", endpoints=endpoints)})
    own = {a.cluster_name: a for a in build_endpoints(_config(), decision)}[
        names.eds_service_name("chat")
    ]
    (local,) = own.endpoints
    assert [_lb(e) for e in local.lb_endpoints] == [{}]
