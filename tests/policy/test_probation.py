"""Probation (policy/health.py): a pod with no page since it (re)started, its page late and
its health check answering, is in rotation at a small weight, bounded in time, and the
Envoys' verdicts and a refused connection still take it out."""

from __future__ import annotations

import statistics

import pytest

from tests.policy.test_scoring import signals as paged
from xds_server.config import BalancingConfig, PoolConfig
from xds_server.policy.scoring import ScoredPool, score_pool
from xds_server.policy.signals import PodSignals
from xds_server.policy.state import EndpointState, Health
from xds_server.tuning import MAX_WEIGHT, Tuning

KEYS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
A, B, C, D = KEYS
SETTINGS = BalancingConfig(smoothing=1.0)
TUNING = Tuning()


def pool(*, session_affinity: bool = False) -> PoolConfig:
    return PoolConfig.model_validate(
        {
            "name": "p",
            "models": ["m"],
            "session_affinity": session_affinity,
            "endpoints": [{"address": key.split(":")[0], "port": 8000} for key in KEYS],
        }
    )


def restarted(probation_s: float | None, **overrides: object) -> PodSignals:
    """A pod whose scrapes since its restart all timed out: no page, placeholders."""
    fields: dict[str, object] = {
        "silent_s": 5.0,
        "waiting": 0,
        "running": 0,
        "scraped": False,
        "probation_s": probation_s,
    }
    fields.update(overrides)
    return PodSignals(**fields)  # type: ignore[arg-type]


def decide(
    signals: dict[str, PodSignals], *, tuning: Tuning = TUNING, **kw: object
) -> dict[str, EndpointState]:
    scored: ScoredPool = score_pool(
        kw.pop("pool", pool()),  # type: ignore[arg-type]
        settings=SETTINGS,
        signals=signals,
        memory=kw.pop("memory", {}),  # type: ignore[arg-type]
        tuning=tuning,
        **kw,  # type: ignore[arg-type]
    )
    return {e.id: e for e in scored.state.endpoints}


def codes(state: EndpointState) -> list[str]:
    return [reason.code for reason in state.reasons]


def within_a_step(weight: int, expected: float, tuning: Tuning = TUNING) -> bool:
    """Weights are quantized to MAX_WEIGHT / ladder^k: within one step of `expected`."""
    return expected / tuning.weight_ladder <= weight <= expected * tuning.weight_ladder


def test_a_restarted_pod_answering_its_health_check_gets_a_small_share() -> None:
    states = decide({A: paged(), B: paged(), C: paged(), D: restarted(3.0)})
    assert states[D].health is Health.HEALTHY
    assert codes(states[D]) == ["probation"]
    assert "3.0 s of 120 s" in states[D].reasons[0].detail
    assert {states[k].weight for k in (A, B, C)} == {MAX_WEIGHT}
    assert within_a_step(states[D].weight, TUNING.probation_weight * MAX_WEIGHT)


def test_its_weight_follows_the_tuning_and_the_median_of_the_pods_in_rotation() -> None:
    tuning = Tuning(probation_weight=0.5)
    # One fresh pod of four times less KV capacity: the median, not the best, is the scale.
    signals = {A: paged(), B: paged(), C: paged(kv_capacity_tokens=20_000), D: restarted(1.0)}
    states = decide(signals, tuning=tuning)
    median = statistics.median(states[k].weight for k in (A, B, C))
    assert median == MAX_WEIGHT
    assert within_a_step(states[D].weight, 0.5 * median, tuning)
    assert states[C].weight < states[D].weight


def test_the_page_from_before_the_restart_does_not_size_it() -> None:
    """A pod restarted while its old page (and smoothed score) stay in the store: it is
    weighed as on probation, not by its score from before."""
    old = paged(silent_s=30.0, waiting=0, running=0, probation_s=2.0)
    memory = {A: 1.0, B: 1.0, C: 1.0, D: 50.0}
    states = decide({A: paged(), B: paged(), C: paged(), D: old}, memory=memory)
    assert codes(states[D]) == ["probation"]
    assert within_a_step(states[D].weight, TUNING.probation_weight * MAX_WEIGHT)


def test_without_a_health_answer_it_stays_out() -> None:
    states = decide({A: paged(), B: paged(), C: paged(), D: restarted(None)})
    assert states[D].health is Health.UNHEALTHY
    assert codes(states[D]) == ["unscraped"]
    # Its old page, stale, and no answer: stale, as before.
    states = decide({A: paged(), B: paged(), C: paged(), D: paged(silent_s=30.0)})
    assert codes(states[D]) == ["stale"]


def test_probation_is_bounded_in_time() -> None:
    tuning = Tuning(probation_max_s=30.0)
    states = decide({A: paged(), B: paged(), C: paged(), D: restarted(30.0)}, tuning=tuning)
    assert codes(states[D]) == ["probation"]
    states = decide({A: paged(), B: paged(), C: paged(), D: restarted(30.5)}, tuning=tuning)
    assert states[D].health is Health.UNHEALTHY
    assert codes(states[D]) == ["probation_ended"]
    assert states[D].weight < states[A].weight / 100


@pytest.mark.parametrize("verdict", ["stalled", "failing"])
def test_a_pod_on_probation_that_hangs_or_fails_requests_is_out(verdict: str) -> None:
    """The gray-failure rule wins: a verdict from the Envoys' reports takes it out."""
    signals = {A: paged(), B: paged(), C: paged(), D: restarted(3.0)}
    states = decide(signals, verdicts={D: verdict})
    assert states[D].health is Health.UNHEALTHY
    assert codes(states[D]) == [verdict]
    assert states[D].verdict == verdict


def test_a_pod_on_probation_whose_port_refuses_is_down() -> None:
    states = decide({A: paged(), B: paged(), C: paged(), D: restarted(3.0, down=True)})
    assert states[D].health is Health.UNHEALTHY
    assert codes(states[D]) == ["down"]


def test_its_first_page_ends_the_probation() -> None:
    states = decide({A: paged(), B: paged(), C: paged(), D: paged()})
    assert codes(states[D]) == [] and states[D].weight == MAX_WEIGHT


def test_a_whole_pool_on_probation_shares_equally() -> None:
    """Every pod restarted at once (a rollout of the engine): none is scored, all serve."""
    for all_stale in ("fail_open", "fail_closed"):
        settings = BalancingConfig(smoothing=1.0, all_stale=all_stale)
        scored = score_pool(
            pool(),
            settings=settings,
            signals={key: restarted(float(i)) for i, key in enumerate(KEYS)},
            memory={},
        )
        endpoints = scored.state.endpoints
        assert {(e.health, e.weight) for e in endpoints} == {(Health.HEALTHY, MAX_WEIGHT)}
        assert {e.reasons[0].code for e in endpoints} == {"probation"}


def test_its_session_keys_are_cut_as_its_weight() -> None:
    signals = {A: paged(), B: paged(), C: paged(), D: restarted(3.0, kv_capacity_tokens=None)}
    states = decide(signals, pool=pool(session_affinity=True))
    rings = {key: states[key].ring_weight for key in KEYS}
    assert rings[A] == rings[B] == rings[C] == MAX_WEIGHT
    ring = rings[D]
    assert ring is not None
    assert within_a_step(ring, TUNING.probation_weight * MAX_WEIGHT)
