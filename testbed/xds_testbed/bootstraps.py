"""Envoy bootstraps for tests and benchmarks that run server replicas as processes.

An Envoy in front of replicas is attached to one of them and moves to another when that one
dies, the way a Kubernetes Service in front of the replicas would move it: its xDS cluster
lists the replicas in priority order, and a TCP health check finds a dead one within a
fraction of a second. (Peering, xds_server/peering, is what lets the survivor take over
the moved Envoy's part of the budgets.)
"""

from __future__ import annotations

from typing import Any

from xds_server.envoy import render_bootstrap
from xds_testbed.server_process import ServerProcess

__all__ = ["failover_bootstrap"]


def failover_bootstrap(
    node_id: str,
    primary: ServerProcess,
    backup: ServerProcess,
    *,
    node_cluster: str = "gateway",
) -> dict[str, Any]:
    """An Envoy bootstrap whose xDS cluster is `primary`, failing over to `backup` when a
    TCP health check (every 0.2 s, one failure) finds `primary` gone, as a Kubernetes
    Service drops a dead pod. Admin on port 0 (EnvoyProcess reads it back)."""
    bootstrap = render_bootstrap(
        xds_address="127.0.0.1",
        xds_port=primary.xds_port,
        node_id=node_id,
        node_cluster=node_cluster,
        admin_port=0,
    )
    [cluster] = bootstrap["static_resources"]["clusters"]

    def endpoint(server: ServerProcess) -> dict[str, Any]:
        address = {"address": "127.0.0.1", "port_value": server.xds_port}
        return {"endpoint": {"address": {"socket_address": address}}}

    cluster["load_assignment"]["endpoints"] = [
        {"priority": 0, "lb_endpoints": [endpoint(primary)]},
        {"priority": 1, "lb_endpoints": [endpoint(backup)]},
    ]
    cluster["health_checks"] = [
        {
            "timeout": "0.5s",
            "interval": "0.2s",
            "no_traffic_interval": "0.2s",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "tcp_health_check": {},
        }
    ]
    return bootstrap
