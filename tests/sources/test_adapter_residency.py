"""LoRA residency: adapters stay counted after their last request, within the pod's slots."""

from __future__ import annotations

from xds_server.metrics.engines import PodMetrics
from xds_server.metrics.store import PodObservation
from xds_server.sources.pod_metrics import AdapterResidency, signals_of


def seen(*running: str, waiting: tuple[str, ...] = (), max_lora: int | None = 2) -> PodObservation:
    metrics = PodMetrics(
        waiting=0,
        running=len(running),
        lora_running=running,
        lora_waiting=waiting,
        max_lora=max_lora,
    )
    return PodObservation(
        metrics=metrics,
        age_s=0.1,
        prefix_hit_rate=None,
        errors_in_a_row=0,
        failing_for_s=None,
        last_error=None,
    )


def test_adapters_stay_resident_until_pushed_out_of_the_slots() -> None:
    residency = AdapterResidency()
    assert residency.update("p", seen("a")) == ("a",)
    assert residency.update("p", seen()) == ("a",)  # idle, but still loaded
    assert residency.update("p", seen("b")) == ("a", "b")
    # A third adapter takes the least recently seen slot.
    assert residency.update("p", seen(waiting=("c",))) == ("b", "c")
    residency.forget_except(set())
    assert residency.update("p", seen()) == ()


def test_resident_adapters_reach_the_policy_signals() -> None:
    signals = signals_of(seen("a"), resident=("b",))
    assert signals is not None and signals.adapters == ("a", "b")
