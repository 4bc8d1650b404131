from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2

# Also imported so that ParseDict can resolve the bootstrap's Any payloads.
from envoy.extensions.bootstrap.internal_listener.v3 import internal_listener_pb2
from envoy.extensions.resource_monitors.downstream_connections.v3 import (
    downstream_connections_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format

from xds_server.envoy import names, render_bootstrap
from xds_server.envoy.bootstrap import MAX_DOWNSTREAM_CONNECTIONS
from xds_testbed import EnvoyProcess

CHECKED_IN = Path(__file__).parents[2] / "envoy" / "bootstrap.yaml"


def _render(**overrides: Any) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "xds_address": "127.0.0.1",
        "xds_port": 18000,
        "node_id": "envoy-local",
        "node_cluster": "llm-gateway",
        "admin_port": 9901,
    }
    return render_bootstrap(**{**arguments, **overrides})


def _parse(bootstrap: dict[str, Any]) -> Any:
    # Strict: an unknown or misspelt field raises.
    return json_format.ParseDict(bootstrap, bootstrap_pb2.Bootstrap())


def test_the_checked_in_bootstrap_is_the_rendered_one() -> None:
    assert yaml.safe_load(CHECKED_IN.read_text()) == _render()


@pytest.mark.parametrize(("delta", "api_type"), [(False, "GRPC"), (True, "DELTA_GRPC")])
def test_everything_comes_over_ads(delta: bool, api_type: str) -> None:
    parsed = _parse(_render(delta=delta))
    ads = parsed.dynamic_resources.ads_config
    assert ads.api_type == ads.ApiType.Value(api_type)
    assert ads.transport_api_version == 2  # V3
    assert ads.grpc_services[0].envoy_grpc.cluster_name == names.XDS_CLUSTER
    for source in (parsed.dynamic_resources.cds_config, parsed.dynamic_resources.lds_config):
        assert source.HasField("ads")
        assert source.resource_api_version == 2
    assert parsed.node.id == "envoy-local"
    assert parsed.node.cluster == "llm-gateway"
    assert parsed.admin.address.socket_address.address == "127.0.0.1"
    assert parsed.admin.address.socket_address.port_value == 9901


@pytest.mark.parametrize("delta", [False, True])
def test_the_ads_stream_is_retried_within_a_second(delta: bool) -> None:
    parsed = _parse(_render(delta=delta))
    (ads,) = parsed.dynamic_resources.ads_config.grpc_services
    back_off = ads.envoy_grpc.retry_policy.retry_back_off
    assert back_off.base_interval.ToMilliseconds() == 100
    assert back_off.max_interval.ToMilliseconds() == 1000
    # Envoy 1.40's load reporter retries on its own fixed timer and reads no retry policy.
    (lrs,) = parsed.cluster_manager.load_stats_config.grpc_services
    assert lrs.envoy_grpc.cluster_name == names.XDS_CLUSTER
    assert not lrs.envoy_grpc.HasField("retry_policy")


def test_the_xds_cluster_speaks_http2() -> None:
    (cluster,) = _parse(_render()).static_resources.clusters
    assert cluster.name == names.XDS_CLUSTER
    assert cluster.type == cluster.STATIC
    options = cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    address = cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address
    assert (address.socket_address.address, address.socket_address.port_value) == (
        "127.0.0.1",
        18000,
    )
    unpacked = http_protocol_options_pb2.HttpProtocolOptions()
    assert options.Unpack(unpacked)
    assert unpacked.explicit_http_config.HasField("http2_protocol_options")


def test_downstream_connections_are_capped() -> None:
    (monitor,) = _parse(_render()).overload_manager.resource_monitors
    config = downstream_connections_pb2.DownstreamConnectionsConfig()
    assert monitor.typed_config.Unpack(config)
    assert config.max_active_downstream_connections == MAX_DOWNSTREAM_CONNECTIONS


def test_internal_listeners_are_enabled() -> None:
    # The spill listeners (listeners.py) are internal: Envoy refuses them without this.
    (extension,) = _parse(_render()).bootstrap_extensions
    assert extension.name == "envoy.bootstrap.internal_listener"
    assert extension.typed_config.Unpack(internal_listener_pb2.InternalListener())


def test_a_server_given_by_name_is_resolved_by_dns() -> None:
    (cluster,) = _parse(_render(xds_address="xds.llm.svc")).static_resources.clusters
    assert cluster.type == cluster.STRICT_DNS


@pytest.mark.parametrize("delta", [False, True])
async def test_envoy_accepts_the_rendered_bootstrap(delta: bool) -> None:
    # No xDS server here: Envoy must start, keep retrying, and report itself disconnected.
    bootstrap = _render(xds_port=1, admin_port=0, delta=delta)
    async with EnvoyProcess(bootstrap) as envoy:
        stats = await envoy.wait_for(
            lambda: envoy.get_stats(r"^control_plane\.connected_state$"), 5
        )
        assert stats == {"control_plane.connected_state": 0}
        assert not any("warning" in line for line in envoy.stderr_tail), envoy.stderr_tail
