"""What LoRA placement (adapters.py) reads of a pool: each adapter's activity, and each
healthy pod as an `AdapterPod`.

vLLM reports its slots only once it has served a LoRA request: a pod that has not yet is
taken to have the pool's `adapter_slots`, else as many as the most any pod of the pool
reports, so that adapters spread at a cold start instead of piling onto the first pod to
report. With neither, pods keep their adapters as reported. With `adapter_slots`, the
adapters are placed before the first LoRA request, so that where they go does not hang on
which pods those requests happened to reach.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from xds_server.config import BalancingConfig, PoolConfig
from xds_server.policy.adapters import AdapterPod, place_adapters
from xds_server.policy.signals import PodSignals, endpoint_id
from xds_server.tuning import MIN_RELATIVE_CAPACITY, Tuning

__all__ = ["activity_of", "pool_placement"]


def activity_of(
    adapters: tuple[str, ...],
    healthy: Sequence[str],
    signals: Mapping[str, PodSignals],
    previous: Mapping[str, float],
    tuning: Tuning,
) -> dict[str, float]:
    """Each adapter's activity (adapters.py): a step towards 1 if a healthy pod runs it
    now, towards 0 if none does; none while no healthy pod has run an adapter (what ran
    before ran on other pods, and would steer the fresh placement, adapters.py)."""
    running: set[str] = set()
    ran = False
    for key in healthy:
        if (s := signals.get(key)) is not None:
            running.update(s.running_adapters if s.running_adapters is not None else s.adapters)
            ran = ran or bool(s.adapters or s.recent_adapters)
    if not ran:
        return dict.fromkeys(adapters, 0.0)
    return {
        adapter: (old := previous.get(adapter, 0.0))
        + tuning.adapter_activity_smoothing * ((adapter in running) - old)
        for adapter in adapters
    }


def _adapter_pod(
    s: PodSignals,
    *,
    slots: int,
    score: float,
    capacity: float,
    name: str,
    settings: BalancingConfig,
) -> AdapterPod:
    running = set(s.running_adapters if s.running_adapters is not None else s.adapters)
    return AdapterPod(
        slots=slots,
        load=s.running + s.waiting,
        waiting=s.waiting > settings.queue_slack,
        score=score,
        adapters=frozenset(s.adapters),
        running_adapters=frozenset(running),
        queued_adapters=frozenset(
            running & set(s.waiting_adapters) if s.waiting_adapters is not None else running
        ),
        recent_adapters=s.recent_adapters,
        name=name,
        queued=s.waiting,
        capacity=capacity,
    )


def pool_placement(
    pool: PoolConfig,
    healthy: Sequence[str],
    signals: Mapping[str, PodSignals],
    scores: Mapping[str, float],
    previous: Mapping[str, tuple[str, ...]],
    activity: Mapping[str, float],
    settings: BalancingConfig,
    tuning: Tuning,
    capacities: Mapping[str, float] = MappingProxyType({}),
) -> dict[str, tuple[str, ...]]:
    """Adapter placement (adapters.py) over the healthy pods (module docstring), their
    `capacities` (relative, capacity.py; absent: 1) setting their shares of the load."""
    reported = [s.max_adapters for k in healthy if (s := signals.get(k)) and s.max_adapters]
    default_slots = pool.adapter_slots or max(reported, default=None)
    if default_slots is None or not any(k in signals for k in healthy):
        return {}
    names = {endpoint_id(e): e.ring_key for e in pool.endpoints}
    pods = {
        key: _adapter_pod(
            s,
            slots=s.max_adapters or default_slots,
            score=scores.get(key, 0.0),
            capacity=max(capacities.get(key, 1.0), MIN_RELATIVE_CAPACITY),
            name=names[key],
            settings=settings,
        )
        for key in healthy
        if (s := signals.get(key)) is not None
    }
    # The slots of every pod of the pool, in rotation or not: a pool crowded by its
    # configuration, not one with pods out for a while (adapters.py, rule 4).
    pool_slots = sum(
        (s.max_adapters if (s := signals.get(key)) and s.max_adapters else default_slots)
        for key in names
    )
    return place_adapters(
        pool.adapters,
        pods,
        previous,
        activity,
        tuning,
        interval_s=settings.scrape_interval_s,
        pool_slots=pool_slots,
    )
