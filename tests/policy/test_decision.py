"""decide(): the whole policy as one pure function of inputs and memory."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.config import parse_config
from xds_server.policy.admission import BandLoad
from xds_server.policy.decision import (
    Decider,
    DecisionInputs,
    FleetLoad,
    PolicyMemory,
    PoolLoad,
    decide,
)
from xds_server.policy.shares import EnvoyDemand
from xds_server.policy.signals import PodSignals
from xds_server.tuning import MAX_WEIGHT

CONFIG = parse_config(
    """
    balancing: {smoothing: 0.5}
    flow_control: {enabled: true, default_pod_concurrency: 10, critical_headroom: 0,
                   sheddable_utilization: 1}
    pools:
      - name: gpu
        models: [m]
        endpoints: [{address: 10.0.0.1, port: 8000}, {address: 10.0.0.2, port: 8000}]
      - name: plain
        models: [n]
        gpu_aware: false
        endpoints: [{address: 10.0.1.1, port: 8000}]
    """
)
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def _signals(waiting_b: float) -> dict[str, PodSignals]:
    return {
        A: PodSignals(silent_s=0.1, waiting=0, running=2),
        B: PodSignals(silent_s=0.1, waiting=waiting_b, running=2),
    }


def _weights(decision) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {e.id: e.weight for e in decision.pools["gpu"].endpoints}


def test_the_same_inputs_and_memory_give_the_same_decision() -> None:
    inputs = DecisionInputs(config=CONFIG, signals=_signals(3))
    assert decide(inputs, PolicyMemory()) == decide(inputs, PolicyMemory())


def test_memory_carries_the_smoothing_from_one_decision_to_the_next() -> None:
    calm, memory = decide(DecisionInputs(config=CONFIG, signals=_signals(0)), PolicyMemory())
    assert _weights(calm) == {A: MAX_WEIGHT, B: MAX_WEIGHT}
    queued = DecisionInputs(config=CONFIG, signals=_signals(5))
    remembered, _ = decide(queued, memory)
    fresh, _ = decide(queued, PolicyMemory())
    # Half-way (smoothing 0.5) from the remembered score: cut, but less than without memory.
    assert fresh.pools["gpu"].endpoints[1].weight < _weights(remembered)[B] < MAX_WEIGHT
    # Only GPU-aware pools are decided on, and remembered.
    assert set(calm.pools) == set(memory.pools) == {"gpu"}


def test_load_keyed_by_pool_cuts_long_prompts_and_sets_band_limits() -> None:
    load = FleetLoad(
        pools={
            "gpu": PoolLoad(
                bands=BandLoad(
                    in_flight={"critical": 4, "standard": 6},
                    completions_per_s=2,
                    by_envoy={
                        "busy": {"standard": EnvoyDemand(in_flight=6, arrivals_per_s=4.0)},
                        "idle": {},
                    },
                ),
                long_prompts={B: 1},
            )
        },
    )
    inputs = DecisionInputs(config=CONFIG, signals=_signals(0), load=load)
    decision, _ = decide(inputs, PolicyMemory())
    assert _weights(decision)[A] == MAX_WEIGHT
    assert _weights(decision)[B] < MAX_WEIGHT / 50
    # Capacity 20: Standard may take 20 - 4, Sheddable 20 - 10, over the fleet. Of the 14
    # places beyond the floors, "busy" asks for 8 (6 in flight, 4/s over 0.5 s): it gets
    # those, and the 6 nobody asks for are shared evenly.
    gpu = decision.admissions["gpu"]
    assert (gpu.budget["standard"], gpu.budget["sheddable"]) == (16, 10)
    assert gpu.limits_of("busy")["standard"] == 12 and gpu.limits_of("idle")["standard"] == 4
    # A pool nobody reported on is admitted on its capacity alone.
    assert decision.admissions["plain"].budget["standard"] == 10


def test_without_signals_or_load_nothing_is_decided() -> None:
    decision, memory = decide(DecisionInputs(config=CONFIG), PolicyMemory())
    assert not decision.pools and not decision.admissions and not memory.pools


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.0, 3.0, 9.0]),  # B's queue: often unchanged
            st.sampled_from([0, 0, 4, 12]),  # Standard in flight over the fleet
            st.sampled_from([("e1",), ("e1", "e2")]),  # the Envoys known
        ),
        min_size=1,
        max_size=12,
    )
)
def test_a_decider_decides_what_a_fresh_decide_does(
    steps: list[tuple[float, int, tuple[str, ...]]],
) -> None:
    """The Decider reuses a pool's last results when its inputs are the same (the policy's
    pay-for-change); whatever came before, each decision must be exactly `decide`'s."""
    decider, memory = Decider(), PolicyMemory()
    for waiting_b, standard, envoys in steps:
        load = FleetLoad(
            pools={
                name: PoolLoad(
                    bands=BandLoad(
                        in_flight={"critical": 0, "standard": standard, "sheddable": 0},
                        by_envoy={e: {"standard": EnvoyDemand(in_flight=standard)} for e in envoys},
                    )
                )
                for name in ("gpu", "plain")
            }
        )
        inputs = DecisionInputs(config=CONFIG, signals=_signals(waiting_b), load=load)
        reused = decider.decide(inputs, memory)
        assert reused == decide(inputs, memory)
        memory = reused[1]
