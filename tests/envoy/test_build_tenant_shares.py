"""Weighted tenants' lanes as the builders describe them: a cluster per tenant and limited
band, route variants before each band's routes, the runtime keys of each Envoy's part, and
the 429 that names the tenant's share (the behaviour is tests/e2e/test_tenant_shares.py's)."""

from __future__ import annotations

from envoy.config.route.v3 import route_components_pb2 as rc_pb2

from tests.envoy.static_bootstrap import hcm_of
from xds_server.config import RoutingConfig, parse_config
from xds_server.envoy import build_clusters, build_listeners, build_routes, names
from xds_server.envoy.runtime import admission_layer, max_requests_key
from xds_server.policy.admission import BandLoad, PodCapacity, admit
from xds_server.policy.decision import Decision
from xds_server.policy.shares import EnvoyDemand
from xds_server.policy.tenant_shares import SHARED_LANE
from xds_server.snapshot_builder import SnapshotBuilder
from xds_server.xds.resources import ResourceType

YAML = """
listener: {address: 127.0.0.1, port: 8080}
flow_control:
  enabled: true
  default_pod_concurrency: 26
  critical_headroom: 0
  tenants:
    header: x-tenant-id
    named:
      a: {weight: 1}
      b: {weight: 2, requests_per_s: 5}
      limited-only: {requests_per_s: 1}
pools:
  - name: llm
    models: [base]
    session_affinity: true
"""


def _config(yaml: str = YAML) -> RoutingConfig:
    return parse_config(yaml)


def _routes(config: RoutingConfig) -> list[rc_pb2.Route]:
    return list(build_routes(config)[0].virtual_hosts[0].routes)


def test_each_weighted_tenant_has_a_lane_per_limited_band() -> None:
    clusters = {c.name: c for c in build_clusters(_config())}
    lanes = {name for name in clusters if names.TENANT_CLUSTER_INFIX in name}
    assert lanes == {
        "llm/standard/t/a",
        "llm/standard/t/b",
        "llm/sheddable/t/a",
        "llm/sheddable/t/b",
    }
    # A copy of the band's cluster in the pool's own lane: its assignment and balancing.
    lane, band = clusters["llm/standard/t/a"], clusters["llm/standard"]
    assert lane.eds_cluster_config == band.eds_cluster_config
    assert lane.load_balancing_policy == band.load_balancing_policy
    assert lane.circuit_breakers == band.circuit_breakers
    # None without flow control.
    off = _config(YAML.replace("enabled: true", "enabled: false"))
    assert not [c for c in build_clusters(off) if names.TENANT_CLUSTER_INFIX in c.name]


def test_a_weighted_tenants_requests_of_a_band_take_its_lane_first() -> None:
    routes = _routes(_config())
    by_name = {route.name: index for index, route in enumerate(routes)}
    tenant_a = routes[by_name["model/base/standard/t/a"]]
    assert tenant_a.route.cluster == "llm/standard/t/a"
    assert [(h.name, h.string_match.exact) for h in tenant_a.match.headers][-1] == (
        "x-tenant-id",
        "a",
    )
    assert tenant_a.metadata.filter_metadata["llm"]["tenant"] == "a"
    assert tenant_a.metadata.filter_metadata["llm"]["band"] == "standard"
    # Before the band's session routes: a session key does not take it out of its lane.
    assert by_name["model/base/standard/t/a"] < by_name["session-model/base/standard"]
    # No lane for Critical (never limited), nor for a tenant without a weight.
    assert not [name for name in by_name if "/critical/" in name and "/t/" in name]
    assert not [name for name in by_name if name.endswith("/t/limited-only")]


def test_a_body_field_tenant_is_matched_by_its_metadata() -> None:
    config = _config(YAML.replace("header: x-tenant-id", "body_field: user"))
    (route,) = [r for r in _routes(config) if r.name == "model/base/standard/t/b"]
    matcher = route.match.dynamic_metadata[-1]
    assert (matcher.filter, matcher.path[0].key, matcher.value.string_match.exact) == (
        "llm",
        "tenant",
        "b",
    )


def test_the_429_of_a_full_share_names_the_tenant() -> None:
    hcm = hcm_of(build_listeners(_config())[0])
    bodies = [m.body_format_override.json_format for m in hcm.local_reply_config.mappers]
    codes = [body["error"]["code"] for body in bodies if "error" in body.fields]
    assert codes.count("tenant_share_exceeded") == 2  # a and b
    # Before the band's own 429: the first mapper that matches wins.
    assert codes.index("tenant_share_exceeded") < codes.index("rate_limit_exceeded")


def _admission(demand_a: float, demand_b: float) -> Decision:
    config = _config()
    load = BandLoad(
        in_flight={},
        by_envoy={"e1": {}, "e2": {}},
        tenants_by_envoy={
            "e1": {"standard": {"a": EnvoyDemand(arrivals_per_s=demand_a)}},
            "e2": {"standard": {"b": EnvoyDemand(arrivals_per_s=demand_b)}},
        },
    )
    admission = admit(
        [PodCapacity(hardware=None, running=0, waiting=0)],
        load=load,
        settings=config.flow_control,
        horizon_s=0.5,
    )
    return Decision(admissions={"llm": admission})


def test_the_band_is_split_by_weight_and_each_part_over_the_envoys_by_demand() -> None:
    admission = _admission(100.0, 100.0).admissions["llm"]
    split = admission.tenants["standard"]
    # Two Envoys: the shared lane keeps its floor of one place each; a and b share 24 1:2.
    assert split.parts == {SHARED_LANE: 2, "a": 8, "b": 16}
    # a's clients are at e1, b's at e2: each Envoy holds all but the other's floor.
    assert admission.tenant_limit("e1", "standard", "a") == 7
    assert admission.tenant_limit("e2", "standard", "a") == 1
    assert admission.tenant_limit("e2", "standard", "b") == 15
    assert admission.tenant_limit(None, "standard", "b") == 1  # an Envoy not named yet
    assert admission.limits_of("e1")["standard"] == 1  # the shared lane's part


def test_each_envoys_runtime_layer_holds_its_part_of_each_tenants_share() -> None:
    config = _config()
    decision = _admission(100.0, 100.0)
    key_a = max_requests_key(names.tenant_cluster_name("llm", "standard", "a"))
    assert admission_layer(config, decision.admissions)[key_a] == 1
    builder = SnapshotBuilder()
    base = builder.build(config, decision)
    own = builder.for_envoys(config, decision, base)
    assert set(own) == {"e1", "e2"}
    (layer_1,) = own["e1"].resources[ResourceType.RUNTIME].values()
    (layer_2,) = own["e2"].resources[ResourceType.RUNTIME].values()
    assert layer_1.message.layer[key_a] == 7
    assert layer_2.message.layer[key_a] == 1
