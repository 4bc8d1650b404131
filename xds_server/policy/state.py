"""The desired state: what the policy decided Envoy should hold for every pool's endpoints.

The policy (scoring.py) produces it from config, pod metrics and the time; the Envoy
builders (xds_server/envoy) turn it into ClusterLoadAssignments. Frozen values, so a state
can be compared with the last one and an unchanged pool costs nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xds_server.config import Band
    from xds_server.policy.admission import PoolAdmission

__all__ = ["DesiredState", "EndpointState", "Health", "PoolState"]


class Health(enum.Enum):
    """An endpoint's EDS health: HEALTHY gets traffic, DRAINING finishes what it has and gets
    nothing new (without counting against the pool's health), UNHEALTHY gets nothing."""

    HEALTHY = "healthy"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, kw_only=True)
class EndpointState:
    address: str
    port: int
    # EDS load_balancing_weight, 1 .. MAX_WEIGHT (scoring.py), and the weight on the
    # session-affinity ring: capacity alone, so that load does not move keys (None: weight).
    weight: int
    ring_weight: int | None = None
    health: Health = Health.HEALTHY
    # LoRA adapters the pod holds or is loading (endpoint metadata for subset routing).
    adapters: tuple[str, ...] = ()
    hardware: str | None = None
    # Long prompts holding the pod (prefilling, as the Envoys told): its weight is cut for them.
    long_prompts: int = 0

    @property
    def id(self) -> str:
        """"address:port", as pods are keyed by the scraper and the policy."""
        return f"{self.address}:{self.port}"


@dataclass(frozen=True, kw_only=True)
class PoolState:
    name: str
    endpoints: tuple[EndpointState, ...] = ()


@dataclass(frozen=True, kw_only=True)
class DesiredState:
    """Endpoint state per pool name. A pool absent here takes its endpoints from config.

    `runtime` holds the Envoy runtime keys the policy sets (for instance
    `circuit_breakers.<cluster>.default.max_requests`), served over RTDS; a change to it
    alone re-sends only the runtime layer.
    """

    pools: Mapping[str, PoolState] = field(default_factory=dict)
    runtime: Mapping[str, float] = field(default_factory=dict)
    # Flow control: the Retry-After of each (pool, band), a route property (RDS), and each
    # pool's admission as decided (for metrics and /debug; nothing is built from it).
    retry_after: Mapping[tuple[str, Band], int] = field(default_factory=dict)
    admissions: Mapping[str, PoolAdmission] = field(default_factory=dict)
