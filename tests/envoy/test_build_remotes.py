"""A pool's remotes in EDS and CDS (envoy/endpoints.py, clusters.py): priority 1 with
their health and weights, the local share held by a placeholder at priority 0, every
local pod out at share 0, TLS per remote by transport socket match, and retries that
move to another priority."""

from __future__ import annotations

from envoy.config.core.v3 import health_check_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2

from xds_server.config import RoutingConfig
from xds_server.envoy import build_clusters, build_pool_endpoints, build_routes, names
from xds_server.envoy._route_to_pools import PREVIOUS_PRIORITIES
from xds_server.policy.failover import PoolFailover, RemoteTarget
from xds_server.policy.state import EndpointState, Health, PoolState

CONFIG = RoutingConfig.model_validate(
    {
        "pools": [
            {
                "name": "gpu",
                "models": ["m"],
                "endpoints": [{"address": "10.0.0.1", "port": 8000}],
                "remotes": [
                    {"name": "east", "address": "192.0.2.1", "port": 443,
                     "tls": {"sni": "gw.east.example", "ca_file": "/etc/remote/ca.pem"}},
                    {"name": "west", "address": "192.0.2.2", "port": 8080},
                ],
            },
            {"name": "solo", "models": ["s"], "endpoints": [{"address": "10.0.0.9", "port": 1}]},
        ]
    }
)  # fmt: skip
POOL = CONFIG.pools[0]
STATE = PoolState(
    name="gpu",
    endpoints=(
        EndpointState(address="10.0.0.1", port=8000, weight=30),
        EndpointState(address="10.0.0.2", port=8000, weight=10),
        EndpointState(address="10.0.0.3", port=8000, weight=50, health=Health.UNHEALTHY),
    ),
)
TARGETS = (
    RemoteTarget(remote="east", address="192.0.2.1", port=443, weight=80, usable=True,
                 tls_match="east"),
    RemoteTarget(remote="west", address="192.0.2.2", port=8080, weight=20, usable=False),
)  # fmt: skip


def _assignment(share: float) -> object:
    failover = PoolFailover(share=share, targets=TARGETS)
    return build_pool_endpoints(POOL, STATE, spills=False, failover=failover)[0]


def test_remotes_go_to_priority_1_and_the_local_pods_stay_at_0() -> None:
    cla = _assignment(1.0)
    local, remote = cla.endpoints  # type: ignore[attr-defined]
    assert (local.priority, remote.priority) == (0, 1)
    assert len(local.lb_endpoints) == 3
    assert remote.locality.zone == names.REMOTE_ZONE
    east, west = remote.lb_endpoints
    assert (east.load_balancing_weight.value, east.health_status) == (80, health_check_pb2.HEALTHY)
    assert west.health_status == health_check_pb2.UNHEALTHY
    assert east.metadata.filter_metadata[names.TRANSPORT_SOCKET_MATCH]["remote"] == "east"
    assert not west.HasField("metadata")
    # All local: Envoy's own failover (P0's health) only; no placeholder.
    assert cla.policy.overprovisioning_factor.value == 300  # type: ignore[attr-defined]
    assert not cla.policy.weighted_priority_health  # type: ignore[attr-defined]


def test_a_local_share_is_held_by_a_placeholder_weight() -> None:
    cla = _assignment(0.25)
    local = cla.endpoints[0]  # type: ignore[attr-defined]
    placeholder = local.lb_endpoints[-1]
    assert placeholder.endpoint.hostname == names.LOCAL_SHARE_HOST
    assert placeholder.health_status == health_check_pb2.UNHEALTHY
    # Healthy local weight 40 is a quarter of 40 + 120.
    assert placeholder.load_balancing_weight.value == 120
    assert cla.policy.overprovisioning_factor.value == 100  # type: ignore[attr-defined]
    assert cla.policy.weighted_priority_health  # type: ignore[attr-defined]


def test_share_0_takes_every_local_pod_out() -> None:
    local = _assignment(0.0).endpoints[0]  # type: ignore[attr-defined]
    assert {e.health_status for e in local.lb_endpoints} == {health_check_pb2.UNHEALTHY}


def test_each_remote_with_tls_gets_its_own_transport_socket_match() -> None:
    clusters = {c.name: c for c in build_clusters(CONFIG)}
    matches = clusters["gpu"].transport_socket_matches
    assert [m.name for m in matches] == ["remote-east"]
    assert dict(matches[0].match) == {"remote": "east"}
    context = tls_pb2.UpstreamTlsContext()
    matches[0].transport_socket.typed_config.Unpack(context)
    assert context.sni == "gw.east.example"
    validation = context.common_tls_context.validation_context
    assert validation.trusted_ca.filename == "/etc/remote/ca.pem"
    assert validation.match_typed_subject_alt_names[0].matcher.exact == "gw.east.example"
    assert not clusters["solo"].transport_socket_matches


def test_retries_of_a_pool_with_remotes_move_to_another_priority() -> None:
    (config,) = build_routes(CONFIG)
    by_cluster = {
        r.route.cluster: r.route.retry_policy
        for vh in config.virtual_hosts
        for r in vh.routes
        if r.route.cluster in ("gpu", "solo")
    }
    assert by_cluster["gpu"].retry_priority.name == PREVIOUS_PRIORITIES
    assert not by_cluster["solo"].HasField("retry_priority")


def test_share_0_takes_the_local_pods_out_of_their_adapters_subsets() -> None:
    pool = POOL.model_copy(update={"adapters": ("lora-a",)})
    state = PoolState(
        name="gpu",
        endpoints=(EndpointState(address="10.0.0.1", port=8000, weight=30, adapters=("lora-a",)),),
    )
    for share, listed in ((1.0, ["lora-a"]), (0.0, None)):
        failover = PoolFailover(share=share, targets=TARGETS)
        cla = build_pool_endpoints(pool, state, spills=False, failover=failover)[0]
        metadata = cla.endpoints[0].lb_endpoints[0].metadata.filter_metadata
        lb = metadata.get(names.LB_METADATA_NAMESPACE)
        assert (list(lb[names.LORA_KEY]) if lb is not None else None) == listed
