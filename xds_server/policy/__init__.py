"""Pure decisions: from config, pod metrics and time to what Envoy should hold."""

from xds_server.policy.state import DesiredState, EndpointState, Health, PoolState

__all__ = ["DesiredState", "EndpointState", "Health", "PoolState"]
