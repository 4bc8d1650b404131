"""Scenario g2: gray failures, pods that look healthy and do not serve, in turn.

On d's fleet and load: a pod wedges (its streams stop after their first chunk, its
`/metrics` and `/health` still answer) and is restarted (its stuck streams cut); a second
pod resets every request it gets (its metrics still fine) and stops; a third claims four
times its KV cache until the end. `inject_gray_faults` runs that schedule beside the
replay and times how long Envoy kept the wedged pod in rotation (polling its admin
`/clusters` for the host's EDS health); `gray_figures` reads the replay's requests:

- `hung_requests`: requests that got no complete answer before the replay's timeout;
- `failed_requests`: requests that failed, but those the wedge itself cut mid-stream
  (`cut_by_wedge`: an answer had begun on the wedged pod, and no gateway can save it);
- `wedged_pod_out_s`: from the wedge to Envoy holding the pod UNHEALTHY (None: never);
- `liar_share`: the liar's share of the requests answered while it lies (from
  LIAR_SETTLE_S after it starts), and `fair_share`, one pod's share of the fleet.

Times are from the trace's start: the moment the fleet sees its first request, less that
request's offset (`first_at_s`), as in scenario g.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from bench.scenarios import GrayFaults
from llm_sim.fleet import Fleet
from llm_sim.loadgen import ReplayResult
from llm_sim.loadgen.results import ErrorKind
from xds_testbed.gateway import LocalGateway

__all__ = ["LIAR_SETTLE_S", "gray_figures", "inject_gray_faults"]

# The liar's share is counted from this long after it starts lying (its page read, its
# weight pushed, the requests it already took drained).
LIAR_SETTLE_S = 5.0
_POLL_S = 0.05


async def inject_gray_faults(
    gateway: LocalGateway, fleet: Fleet, faults: GrayFaults, *, pool: str, first_at_s: float
) -> dict[str, Any]:
    """Run `faults` against the fleet while the trace replays; the fault times and
    `wedged_pod_out_s`."""
    loop = asyncio.get_running_loop()
    while not any(pod.state_snapshot().in_flight for pod in fleet):  # noqa: ASYNC110
        await asyncio.sleep(0.002)
    start = loop.time() - first_at_s

    async def at(offset_s: float) -> None:
        await asyncio.sleep(max(0.0, start + offset_s - loop.time()))

    wedged, resetting, liar = fleet[faults.wedge_pod], fleet[faults.reset_pod], fleet[faults.liar]
    try:
        await at(faults.wedge_s)
        wedged_at = loop.time()
        wedged.wedge(after_chunks=1)
        out_at = await _out_of_rotation(gateway, pool, wedged.port, until=start + faults.unwedge_s)
        await at(faults.unwedge_s)
        # Restarted, as an operator (or a liveness probe) would: the stuck streams are cut.
        await wedged.kill()
        await wedged.revive()
        await at(faults.reset_s)
        resetting.reset_requests(True)
        await at(faults.reset_end_s)
        resetting.reset_requests(False)
        await at(faults.liar_s)
        liar.claim_capacity(faults.liar_factor)
        await at(faults.liar_end_s)
    finally:
        wedged.unwedge()
        resetting.reset_requests(False)
        liar.claim_capacity(1.0)
    return {
        "gray_faults": {
            "wedged_pod": faults.wedge_pod,
            "wedge_s": wedged_at - start,
            "unwedge_s": faults.unwedge_s,
            "resetting_pod": faults.reset_pod,
            "reset_s": faults.reset_s,
            "reset_end_s": faults.reset_end_s,
            "liar": faults.liar,
            "liar_factor": faults.liar_factor,
            "liar_s": faults.liar_s,
            "liar_end_s": faults.liar_end_s,
        },
        "wedged_pod_out_s": None if out_at is None else out_at - wedged_at,
    }


async def _out_of_rotation(
    gateway: LocalGateway, pool: str, port: int, *, until: float
) -> float | None:
    """The loop time Envoy first held the host on `port` of `pool` UNHEALTHY, polling its
    admin until `until` (None: not by then)."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        document = await gateway.envoy.clusters_json()
        for cluster in document.get("cluster_statuses", []):
            if cluster.get("name") != pool:
                continue
            for host in cluster.get("host_statuses", []):
                address = host.get("address", {}).get("socket_address", {})
                health = host.get("health_status", {}).get("eds_health_status")
                if address.get("port_value") == port and health == "UNHEALTHY":
                    return loop.time()
        await asyncio.sleep(_POLL_S)
    return None


def gray_figures(
    result: ReplayResult, faults: GrayFaults, pods: Sequence[str], injected: dict[str, Any]
) -> dict[str, Any]:
    """results.json's g2 keys (module docstring), from the replay and the schedule."""
    requests = result.results
    hung = sum(1 for r in requests if r.error is ErrorKind.TIMEOUT)
    cut = [
        r
        for r in requests
        if r.status == 200
        and r.error in (ErrorKind.RESET, ErrorKind.INCOMPLETE)
        and r.backend_id == faults.wedge_pod
        and faults.wedge_s - 60 <= r.scheduled_at_s <= faults.unwedge_s
    ]
    failed = sum(1 for r in requests if r.status != 200 or r.error is not None) - len(cut) - hung
    lying = [
        r
        for r in requests
        if r.status == 200
        and r.error is None
        and faults.liar_s + LIAR_SETTLE_S <= r.scheduled_at_s <= faults.liar_end_s
    ]
    liar_share = (
        sum(1 for r in lying if r.backend_id == faults.liar) / len(lying) if lying else None
    )
    return {
        **injected,
        "hung_requests": hung,
        "failed_requests": failed,
        "cut_by_wedge": len(cut),
        "liar_share": liar_share,
        "fair_share": 1 / len(pods),
        "liar_requests_counted": len(lying),
    }
