"""Endpoint states: what the policy decided Envoy should hold for each pool's endpoints.

The policy (scoring.py) produces them from config and pod metrics, as part of a Decision
(decision.py); the Envoy builders (xds_server/envoy) turn them into
ClusterLoadAssignments. Frozen values, so a state can be compared with the last one and an
unchanged pool costs nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from xds_server.policy.reasons import SPILL_CODES, Reason

__all__ = ["EndpointState", "Health", "PoolState"]


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
    # What the session-affinity ring hashes (config.EndpointConfig.name; None: `id`).
    name: str | None = None
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
    # The pod queues or prefills a long prompt: for now its keys' new requests go to other
    # pods (its session-table entries point at the pool's spill listener, or with
    # `spill_to: ring` it is UNHEALTHY there; envoy/endpoints.py) and come back when it
    # recovers (other pods' keys do not move), and it is DEGRADED in the pool's
    # assignment, so it gets no new request while another pod is healthy.
    spilling: bool = False
    # Why the Envoys' reports took the pod out of rotation ("stalled", "failing"), if so.
    verdict: str | None = None
    # With `balancing.key_homes` "buckets": the key buckets pinned to the pod, those no pod
    # holds that it is offered (a spare's arcs), and whether keys of a bucket listed
    # nowhere go to it (policy/buckets.py; envoy/endpoints.py lists all three).
    key_buckets: tuple[int, ...] = ()
    key_offers: tuple[int, ...] = ()
    key_spare: bool = False
    # Why it has this state, in the order the rules ran (reasons.py). Not compared: a
    # state whose figures moved but whose weights did not is the same state for Envoy.
    reasons: tuple[Reason, ...] = field(default=(), compare=False)

    @property
    def listed_buckets(self) -> tuple[int, ...]:
        """The key buckets whose keys go to the pod: pinned and offered."""
        return tuple(sorted(self.key_buckets + self.key_offers))

    @property
    def id(self) -> str:
        """ "address:port", as pods are keyed by the scraper and the policy."""
        return f"{self.address}:{self.port}"

    @property
    def state(self) -> str:
        """healthy, spilling (healthy, its keys sent elsewhere), draining or unhealthy."""
        if self.spilling and self.health is Health.HEALTHY:
            return "spilling"
        return self.health.value

    @property
    def spill_reason(self) -> str | None:
        """The code of the rule that makes it spill (None when it does not)."""
        if not self.spilling:
            return None
        return next((r.code for r in self.reasons if r.code in SPILL_CODES), None)

    def to_json(self) -> dict[str, object]:
        """The state as /debug/decision shows it."""
        return {
            "pod": self.id,
            "name": self.name,
            "state": self.state,
            "weight": self.weight,
            "ring_weight": self.ring_weight,
            "health": self.health.value,
            "spilling": self.spilling,
            "long_prompts": self.long_prompts,
            "adapters": list(self.adapters),
            "hardware": self.hardware,
            "verdict": self.verdict,
            "reasons": [{"code": r.code, "detail": r.detail} for r in self.reasons],
        }

    @property
    def ring_key(self) -> str:
        """What Envoy hashes for this endpoint on a session-affinity ring."""
        return self.name or self.id


@dataclass(frozen=True, kw_only=True)
class PoolState:
    name: str
    endpoints: tuple[EndpointState, ...] = ()
    # Session affinity does not pay here (affinity.py): the keys' requests are balanced by
    # load, like unkeyed ones (envoy/endpoints.py), and each healthy endpoint says why.
    keys_suspended: bool = False
