"""Pods judged from the Envoys' load reports (xds_server/verdicts.py), on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from xds_server.config import RoutingConfig, parse_config
from xds_server.sources.probe import ProbeFailure
from xds_server.verdicts import PROBE_FIRST_S, PodVerdicts, run_probes
from xds_server.xds.load_reports import ClusterLoad, Rates

PODS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
INTERVAL_S = 0.25
NO_ANSWER = ProbeFailure(
    "no complete answer within 1 s of its first chunk", timed_out=True, started=True
)
# A probe that waited behind the pod's queue and never began.
NOT_BEGUN = ProbeFailure("no answer began within 5 s", timed_out=True)


def _config(pods: list[str] = PODS, **verdicts: object) -> RoutingConfig:
    endpoints = "".join(
        f"\n      - {{address: {p.split(':')[0]}, port: {p.split(':')[1]}}}" for p in pods
    )
    extra = "".join(f"\n  {k}: {v}" for k, v in verdicts.items())
    return parse_config(
        f"pools:\n  - name: p\n    models: [m]\n    endpoints:{endpoints}\n"
        + (f"verdicts:{extra}\n" if extra else "")
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _load(
    in_flight: Mapping[str, int], finished: Mapping[str, tuple[int, int]], now: float
) -> ClusterLoad:
    """A report of requests in flight, and of those finished (ok, failed) in its interval:
    with the pod's requests in flight unchanged, it issued as many as finished."""
    return ClusterLoad(
        in_progress=sum(in_flight.values()),
        by_endpoint={k: v for k, v in in_flight.items() if v},
        issued_by_endpoint={k: (ok + bad, bad) for k, (ok, bad) in finished.items()},
        rates=Rates(),
        interval_s=INTERVAL_S,
        reported_at=now,
    )


class Fleet:
    """One Envoy reporting every INTERVAL_S on a pool of four pods, each with `in_flight`
    requests and finishing `rate` per second (as a fraction accumulated to whole ones).
    Every probe due is answered at once: served, unless `broken` names the pod."""

    def __init__(self, config: RoutingConfig) -> None:
        self.clock = Clock()
        self.changes = 0
        self.made: list[str] = []
        self.verdicts = PodVerdicts(
            lambda: config, clock=self.clock, on_change=self._changed, observe=self.made.append
        )
        self._credit = dict.fromkeys(PODS, 0.0)
        self.broken: set[str] = set()
        self.failure = NO_ANSWER
        self.suspected: list[str] = []
        self.verdict_probes: list[str] = []
        self.second_looks: list[str] = []
        # False: probes are left due, for the test to answer.
        self.probe_inline = True

    def _changed(self) -> None:
        self.changes += 1

    def run(
        self,
        seconds: float,
        in_flight: Mapping[str, int],
        rate: Mapping[str, float],
        failed: Mapping[str, float] | None = None,
    ) -> None:
        failed = failed or {}
        for _ in range(round(seconds / INTERVAL_S)):
            self.clock.now += INTERVAL_S
            finished = {}
            for pod in PODS:
                self._credit[pod] += rate.get(pod, 0.0) * INTERVAL_S
                ok = int(self._credit[pod])
                self._credit[pod] -= ok
                bad = round(failed.get(pod, 0.0) * INTERVAL_S)
                if ok or bad:
                    finished[pod] = (ok, bad)
            load = _load(in_flight, finished, self.clock.now)
            self.verdicts.reported("envoy-1", {"p": load}, self.clock.now)
            for key, _, timeout_s in self.verdicts.due_probes() if self.probe_inline else ():
                if key in self.judged():
                    assert timeout_s == 5.0
                    self.verdict_probes.append(key)
                elif timeout_s == 5.0:  # a second look at a suspect
                    self.second_looks.append(key)
                else:
                    assert timeout_s == 1.0
                    self.suspected.append(key)
                self.verdicts.probed(key, self.failure if key in self.broken else None)

    def judged(self) -> dict[str, str]:
        return self.verdicts.of_pool("p")


# Four pods with 8 requests in flight each, finishing 16 per second: 0.5 s per request.
BUSY = dict.fromkeys(PODS, 8)
SERVING = dict.fromkeys(PODS, 16.0)


def test_a_pod_whose_requests_stop_finishing_is_suspected_and_judged_on_its_probe() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    assert fleet.judged() == {} and fleet.suspected == []
    fleet.broken.add(PODS[0])
    wedged = {**SERVING, PODS[0]: 0.0}
    elapsed = 0.0
    while not fleet.judged() and elapsed < 10:
        fleet.run(INTERVAL_S, BUSY, wedged)
        elapsed += INTERVAL_S
    assert fleet.judged() == {PODS[0]: "stalled"}
    # 8 in flight at 0.5 s per request owe 16 completions a second: 6 in 0.4 s, and
    # quiet for at least 0.5 s; then its probe is not answered.
    assert elapsed <= 0.75
    assert fleet.suspected == [PODS[0]]
    # A pod that served at its peers' pace gets no second look: judged at once.
    assert fleet.second_looks == []
    assert fleet.made == ["stalled"]
    detail = fleet.verdicts.to_json()[0]
    assert detail["pod"] == PODS[0] and "owes" in str(detail["detail"])
    assert "no complete answer" in str(detail["detail"])


def test_a_suspect_that_finishes_requests_while_its_probe_times_out_is_slow_not_stalled() -> None:
    """Seen on scenario a with the host short of CPU: a busy H100 pod owed completions, its
    probe's second token came after the 1 s, and it was out for 9 s while it served. The
    Envoys saw it finish requests meanwhile: no verdict. A wedged pod finishes none."""
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    fleet.probe_inline = False
    quiet = {**SERVING, PODS[0]: 0.0}
    while fleet.verdicts.next_probe_at() is None:
        fleet.run(INTERVAL_S, BUSY, quiet)
    (key, _, _), *_ = fleet.verdicts.due_probes()
    fleet.run(1.0, BUSY, SERVING)  # finishing requests while the probe is out
    fleet.verdicts.probed(key, NO_ANSWER)
    assert fleet.judged() == {} and fleet.made == []
    # Quiet again, and quiet while probed: stalled.
    while fleet.verdicts.next_probe_at() is None:
        fleet.run(INTERVAL_S, BUSY, quiet)
    (key, _, _), *_ = fleet.verdicts.due_probes()
    fleet.run(1.0, BUSY, quiet)
    fleet.verdicts.probed(key, NO_ANSWER)
    assert fleet.judged() == {PODS[0]: "stalled"}


def test_a_suspect_whose_probe_never_began_waited_in_a_queue_and_is_not_judged() -> None:
    """A slow pod (an A10G beside H100s, scenario a) owes completions at its pool's pace
    and queues: a probe's answer that does not begin within probe_timeout_s waited there.
    A pod that answers nothing at all is out by its scrapes or its engine's counters."""
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    fleet.broken.add(PODS[0])
    fleet.failure = NOT_BEGUN
    fleet.run(5, BUSY, {**SERVING, PODS[0]: 0.0})
    assert PODS[0] in fleet.suspected
    assert fleet.judged() == {} and fleet.made == []


def test_a_suspect_with_no_page_since_it_restarted_whose_probe_never_began_is_stalled() -> None:
    """A pod on probation (its page late since it restarted, policy/health.py) is sent a
    small share and has no counters read: a probe that never begins is a stall there."""
    fleet = Fleet(_config())
    fleet.verdicts = PodVerdicts(
        lambda: _config(),
        clock=fleet.clock,
        observe=fleet.made.append,
        unpaged=lambda key: key == PODS[0],
    )
    fleet.run(10, BUSY, SERVING)
    fleet.broken.add(PODS[0])
    fleet.failure = NOT_BEGUN
    fleet.run(5, BUSY, {**SERVING, PODS[0]: 0.0})
    assert fleet.suspected == [PODS[0]]
    assert fleet.judged() == {PODS[0]: "stalled"}
    assert "no answer began" in str(fleet.verdicts.to_json()[0]["detail"])
    # Its probe is served: back, as any judged pod.
    fleet.broken.clear()
    fleet.run(10, BUSY, SERVING)
    assert fleet.judged() == {}


def test_a_slow_pod_whose_second_token_is_late_passes_its_second_look() -> None:
    """A10G-like pods beside H100s (scenario a): a batch's decode step takes longer than
    confirm_timeout_s, so a probe's answer begins and then pauses past it. The second
    look, given probe_timeout_s, is served: no verdict."""
    fleet = Fleet(_config())
    slow = {**SERVING, PODS[0]: 16.0 / 4}  # four times its peers' time per request
    fleet.run(10, BUSY, slow)
    fleet.probe_inline = False
    while fleet.verdicts.next_probe_at() is None:
        fleet.run(INTERVAL_S, BUSY, {**SERVING, PODS[0]: 0.0})
    [(key, _, timeout_s)] = fleet.verdicts.due_probes()
    assert timeout_s == 1.0
    fleet.verdicts.probed(key, NO_ANSWER)
    [(key, _, timeout_s)] = fleet.verdicts.due_probes()
    assert timeout_s == 5.0
    fleet.verdicts.probed(key, None)
    assert fleet.judged() == {} and fleet.made == []
    assert fleet.verdicts.next_probe_at() is None
    # Slow and wedged: the second look stops too.
    while fleet.verdicts.next_probe_at() is None:
        fleet.run(INTERVAL_S, BUSY, {**SERVING, PODS[0]: 0.0})
    [(key, _, _)] = fleet.verdicts.due_probes()
    fleet.verdicts.probed(key, NO_ANSWER)
    [(key, _, _)] = fleet.verdicts.due_probes()
    fleet.verdicts.probed(key, NO_ANSWER)
    assert fleet.judged() == {PODS[0]: "stalled"}


def test_a_suspect_whose_probe_is_served_is_cleared() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    # Finishing in cohorts, a request's time apart: it owes 8 between cohorts.
    for _ in range(20):
        fleet.run(0.5, BUSY, {**SERVING, PODS[0]: 0.0})
        fleet.run(0.25, BUSY, {**SERVING, PODS[0]: 96.0})
    assert fleet.suspected and set(fleet.suspected) == {PODS[0]}
    assert fleet.judged() == {} and fleet.made == []


def test_pods_serving_at_their_pace_are_not_judged_over_a_long_run() -> None:
    fleet = Fleet(_config())
    # A slower pod (a third of the others' rate) keeps fewer... but as many requests: it
    # is judged by its own pace, not its peers'.
    slow = {**SERVING, PODS[3]: 16.0 / 3}
    fleet.run(600, BUSY, slow)
    assert fleet.judged() == {}
    assert fleet.made == []


def test_a_pod_with_one_long_request_is_given_its_time() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    # Two requests in flight, nothing finished for 10 s: it owes 40, but two requests
    # are no stall (one long generation is not a wedged pod).
    fleet.run(10, {**BUSY, PODS[0]: 2}, {**SERVING, PODS[0]: 0.0})
    assert fleet.judged() == {}


def test_requests_finishing_in_cohorts_a_pace_apart_are_no_stall() -> None:
    fleet = Fleet(_config())
    # Each pod finishes its 8 requests together every 0.5 s (one size, started together):
    # it owes 8 between cohorts, but is never quiet for two requests' time.
    for _ in range(200):
        fleet.run(0.25, BUSY, {})
        fleet.run(0.25, BUSY, dict.fromkeys(PODS, 64.0))
    assert fleet.judged() == {}


def test_a_stalled_pod_stays_out_until_a_probe_says_it_serves() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    fleet.broken.add(PODS[0])
    fleet.run(3, BUSY, {**SERVING, PODS[0]: 0.0})
    assert fleet.judged() == {PODS[0]: "stalled"}
    # Its requests leave (clients giving up look the same as completions): no evidence.
    fleet.run(3, BUSY, SERVING)
    assert fleet.judged() == {PODS[0]: "stalled"}
    changes = fleet.changes
    fleet.verdicts.probed(PODS[0], None)
    assert fleet.judged() == {}
    assert fleet.changes == changes + 1


def test_a_pod_failing_most_of_its_requests_is_judged_failing() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    # It resets what it gets at once: nothing in flight, nothing finished, all failed.
    fleet.run(2, {**BUSY, PODS[1]: 0}, {**SERVING, PODS[1]: 0.0}, failed={PODS[1]: 8.0})
    assert fleet.judged() == {PODS[1]: "failing"}
    assert "failed" in str(fleet.verdicts.to_json()[0]["detail"])


def test_a_few_failures_among_successes_are_not_a_verdict() -> None:
    fleet = Fleet(_config())
    fleet.run(30, BUSY, SERVING, failed={PODS[1]: 2.0})
    assert fleet.judged() == {}


def test_at_most_half_a_pool_is_judged_and_a_pool_of_one_never() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    fleet.broken.update(PODS)
    fleet.run(5, BUSY, {**SERVING, PODS[0]: 0.0, PODS[1]: 0.0, PODS[2]: 0.0})
    assert len(fleet.judged()) == 2
    alone = Fleet(_config([PODS[0]]))
    alone.run(20, {PODS[0]: 8}, {}, failed={PODS[0]: 8.0})
    assert alone.judged() == {}


def test_verdicts_can_be_turned_off() -> None:
    fleet = Fleet(_config(enabled="false"))
    fleet.run(10, BUSY, SERVING)
    fleet.run(5, BUSY, {**SERVING, PODS[0]: 0.0})
    assert fleet.judged() == {}


def test_probes_are_due_after_a_verdict_back_off_and_lift_it() -> None:
    fleet = Fleet(_config(probe_max_interval_s=4))
    fleet.run(10, BUSY, SERVING)
    while not fleet.judged():
        fleet.run(INTERVAL_S, {**BUSY, PODS[0]: 0}, {**SERVING, PODS[0]: 0.0}, {PODS[0]: 8.0})
        assert fleet.clock.now < 200
    verdicts = fleet.verdicts
    assert verdicts.due_probes() == []
    fleet.clock.now += PROBE_FIRST_S
    assert verdicts.due_probes() == [(PODS[0], "m", 5.0)]
    # Being probed: not due again until it is told how the probe went.
    assert verdicts.due_probes() == [] and verdicts.next_probe_at() is None
    intervals = []
    for _ in range(4):
        verdicts.probed(PODS[0], ProbeFailure("HTTP 500"))
        next_at = verdicts.next_probe_at()
        assert next_at is not None
        intervals.append(next_at - fleet.clock.now)
        fleet.clock.now = next_at
        assert verdicts.due_probes() == [(PODS[0], "m", 5.0)]
    assert intervals == [2.0, 4.0, 4.0, 4.0]
    verdicts.probed(PODS[0], None)
    assert fleet.judged() == {}
    # Its failures are forgotten with the verdict: good requests keep it in rotation.
    fleet.run(5, BUSY, SERVING)
    assert fleet.judged() == {}


def test_an_envoy_that_goes_away_no_longer_holds_requests_in_flight() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    fleet.verdicts.closed("envoy-1")
    # Nothing reported in flight: nothing owed, however long.
    fleet.clock.now += 60
    fleet.verdicts.reported("envoy-2", {"p": _load({}, {}, fleet.clock.now)}, fleet.clock.now)
    assert fleet.judged() == {}


@pytest.mark.parametrize("outcome", [None, ProbeFailure("HTTP 503")])
async def test_run_probes_probes_a_judged_pod_and_reports_back(
    outcome: ProbeFailure | None,
) -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    fleet.broken.add(PODS[0])
    while not fleet.judged():
        fleet.run(INTERVAL_S, BUSY, {**SERVING, PODS[0]: 0.0})
    assert fleet.judged() == {PODS[0]: "stalled"}
    due = fleet.verdicts.next_probe_at()
    assert due is not None
    fleet.clock.now = due
    probed: list[tuple[str, int, str]] = []
    done = asyncio.Event()

    async def probe(
        host: str, port: int, model: str, *, timeout_s: float, first_chunk_s: float
    ) -> ProbeFailure | None:
        probed.append((host, port, model))
        done.set()
        return outcome

    task = asyncio.create_task(
        run_probes(fleet.verdicts, asyncio.Event(), clock=fleet.clock, probe=probe)
    )
    try:
        await asyncio.wait_for(done.wait(), 10)
        await asyncio.sleep(0)
    finally:
        task.cancel()
    assert probed[0] == ("10.0.0.1", 8000, "m")
    assert fleet.judged() == ({} if outcome is None else {PODS[0]: "stalled"})


def test_a_pod_slower_per_request_than_its_peers_gains_slowness_and_loses_it_after() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    # Three times its peers' time per request: a step once that shows over the last
    # seconds and has lasted 1.5 s, then one every 1.5 s.
    slow = {**SERVING, PODS[3]: 16.0 / 3}
    elapsed = 0.0
    while not fleet.verdicts.slowness_of_pool("p"):
        fleet.run(INTERVAL_S, BUSY, slow)
        elapsed += INTERVAL_S
        assert elapsed < 10
    assert 1.5 <= elapsed <= 4.0
    assert fleet.verdicts.slowness_of_pool("p") == {PODS[3]: 1}
    changes = fleet.changes
    fleet.run(30, BUSY, slow)
    assert fleet.verdicts.slowness_of_pool("p") == {PODS[3]: 4}
    assert fleet.changes == changes + 3
    # At its peers' pace again (as it shows over a second): a step less a minute.
    fleet.run(59, BUSY, SERVING)
    assert fleet.verdicts.slowness_of_pool("p") == {PODS[3]: 4}
    fleet.run(4, BUSY, SERVING)
    assert fleet.verdicts.slowness_of_pool("p") == {PODS[3]: 3}
    assert fleet.judged() == {}


def test_a_little_slower_is_no_slowness() -> None:
    fleet = Fleet(_config())
    fleet.run(60, BUSY, {**SERVING, PODS[3]: 16.0 / 1.4})
    assert fleet.verdicts.slowness_of_pool("p") == {}


def test_a_suspect_whose_probe_is_refused_is_judged_failing() -> None:
    fleet = Fleet(_config())
    fleet.run(10, BUSY, SERVING)
    fleet.broken.add(PODS[0])
    fleet.failure = ProbeFailure("ClientOSError: connection reset by peer")
    fleet.run(2, BUSY, {**SERVING, PODS[0]: 0.0})
    assert fleet.judged() == {PODS[0]: "failing"}
