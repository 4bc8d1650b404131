"""Pure decisions: from config, pod signals and the Envoys' load to what Envoy should hold.

`decide` (decision.py) is the whole policy; scoring.py, adapters.py and admission.py are
its parts.
"""

from xds_server.policy.decision import (
    Decision,
    DecisionInputs,
    FleetLoad,
    PolicyMemory,
    PoolLoad,
    PoolMemory,
    decide,
)
from xds_server.policy.state import EndpointState, Health, PoolState

__all__ = [
    "Decision",
    "DecisionInputs",
    "EndpointState",
    "FleetLoad",
    "Health",
    "PolicyMemory",
    "PoolLoad",
    "PoolMemory",
    "PoolState",
    "decide",
]
