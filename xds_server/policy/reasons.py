"""Why an endpoint has the state it has: each rule that shaped it says so.

A `Reason` is a code from a bounded set (`CODES`: what metrics label with) and a detail
with the figures that triggered it (for people: `/debug/decision`), e.g. code
`spill_queue` with detail `queue 14 > slack 1 + 2x median 5`. An endpoint's reasons come
in the order the rules ran: its health first, then why it spills, then what cut its weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "CODES",
    "Reason",
    "ReasonCode",
    "SPILL_CODES",
]

ReasonCode = Literal[
    # Health: out of rotation, or not in it yet.
    "draining",
    "down",
    "stalled",
    "failing",
    "stale",
    "unscraped",
    "capacity_unbelieved",
    "all_stale_fail_open",
    # A restarted pod whose page is late and whose health check answers: in rotation at a
    # small weight (health.py); out once that lasted too long.
    "probation",
    "probation_ended",
    # Spilling session keys (spill.py), or a long prompt prefilling.
    "spill_queue",
    "spill_batch_full",
    "spill_batch_ahead",
    "spill_held",
    "spill_capped",
    "spill_everywhere",
    "long_prompt",
    # A ring weight moved off its capacity's to even out key homes (homes.py).
    "home_share",
    # The pool's keys are balanced by load: affinity does not pay there (affinity.py).
    "affinity_suspended",
    # What cut a weight below the best pod's (factors.py).
    "weight_capacity",
    "weight_slow",
    "weight_queue",
    "weight_kv_cache",
    "weight_running",
    "weight_prefix_cache",
]
CODES: tuple[ReasonCode, ...] = get_args(ReasonCode)
# The codes of the rules that make a pod spill.
SPILL_CODES: frozenset[ReasonCode] = frozenset(
    {"spill_queue", "spill_batch_full", "spill_batch_ahead", "spill_held", "long_prompt"}
)


@dataclass(frozen=True)
class Reason:
    code: ReasonCode
    detail: str

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"
