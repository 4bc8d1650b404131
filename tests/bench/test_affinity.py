"""The session-key figures from scripted replays (pure: no sockets, no simulator)."""

from __future__ import annotations

import pytest

from bench.affinity import QueueEpisode, group_homes, key_figures, queue_episodes
from bench.runner import _merge_nested
from bench.scenarios import build_scenario
from llm_sim.loadgen import (
    PromptPart,
    ReplayResult,
    RequestResult,
    Trace,
    TraceRequest,
    TraceSpec,
    generate_trace,
)
from llm_sim.profiles import nominal_capacity

START = 1000.0


def trace_of(users: list[str | None], groups: list[int | None] | None = None) -> Trace:
    spec = TraceSpec(duration_s=len(users) + 1, rate_per_s=1)
    groups = groups if groups is not None else [None] * len(users)
    return Trace(
        spec=spec,
        seed=0,
        requests=tuple(
            TraceRequest(
                index=i,
                at_s=float(i),
                model=spec.model,
                request_class="default",
                prompt_words=1,
                parts=(PromptPart("q", i, 1),),
                max_tokens=1,
                adapter=None,
                band="standard",
                session=None,
                turn=0,
                prefix_group=group,
                user=user,
            )
            for i, (user, group) in enumerate(zip(users, groups, strict=True))
        ),
    )


def replay_of(sent: list[tuple[float, str]]) -> ReplayResult:
    """Request i sent at sent[i][0] (seconds from the start) and served by sent[i][1]."""
    return ReplayResult(
        url="http://x",
        trace_seed=0,
        started_at_unix=START,
        time_scale=1.0,
        max_in_flight=10,
        duration_s=10.0,
        results=tuple(
            RequestResult(
                index=i,
                band="standard",
                model="m",
                scheduled_at_s=at,
                lateness_s=0.0,
                status=200,
                backend_id=pod,
            )
            for i, (at, pod) in enumerate(sent)
        ),
        loop_lag_p50_s=0.0,
        loop_lag_p99_s=0.0,
        loop_lag_max_s=0.0,
        send_lateness_p99_s=0.0,
        saturated=False,
        cpu_s=0.0,
    )


def test_queue_episodes_merge_close_stretches_and_close_at_the_end() -> None:
    samples = [
        (0.00, {"a": 0, "b": 3}),
        (0.02, {"a": 2, "b": 3}),
        (0.04, {"a": 1, "b": 0}),  # a's first stretch ends; b's only one
        (0.06, {"a": 2, "b": 1}),  # 20 ms later: the same episode of a
        (0.30, {"a": 0, "b": 1}),
        (0.50, {"a": 5, "b": 0}),  # a new one, open at the end
    ]
    assert queue_episodes(samples, slack=1, merge_s=0.1) == [
        QueueEpisode("b", 0.0, 0.04),
        QueueEpisode("a", 0.02, 0.30),
        QueueEpisode("a", 0.50, 0.50),
    ]


def test_stickiness_per_key_and_the_heavy_keys_spill() -> None:
    users = ["user-heavy-0"] * 6 + ["user-light-0"] * 4 + ["user-light-1"] * 3 + [None]
    sent = [
        # The heavy key lives on p0, which queues from 2.0 to 3.0: one more request goes
        # there at 2.1, the next leaves at 2.3; p0 is back at 3.5.
        (1.0, "p0"),
        (1.5, "p0"),
        (2.1, "p0"),
        (2.3, "p1"),
        (2.6, "p1"),
        (3.5, "p0"),
        # light-0 on p2 (one request moved), light-1 on p0 (the heavy key's home).
        (1.0, "p2"),
        (2.0, "p2"),
        (3.0, "p3"),
        (4.0, "p2"),
        (1.0, "p0"),
        (2.0, "p0"),
        (3.0, "p0"),
        (1.0, "p3"),  # nobody's
    ]
    episodes = [
        QueueEpisode("p0", START + 2.0, START + 3.0),
        QueueEpisode("p3", START + 2.0, START + 2.2),  # nobody of the heavy key's there
        QueueEpisode("p2", START + 2.5, START + 2.55),  # a step's wait, not a queue
    ]
    # The server takes p0 off the session table 0.2 s into its queue.
    spilled = [(START + t, pods) for t, pods in ((1.98, set()), (2.2, {"p0"}), (3.2, set()))]
    figures = key_figures(trace_of(users), replay_of(sent), episodes=episodes, spilled=spilled)
    sticky = figures["key_stickiness"]
    assert sticky["heavy"] == {"user-heavy-0": pytest.approx(4 / 6)}
    assert sticky["heavy_homes"] == {"user-heavy-0": "p0"}
    assert sticky["light_unloaded"] == {
        "keys": 1,
        "requests": 4,
        "weighted": 0.75,
        "median": 0.75,
        "min": 0.75,
    }
    assert sticky["light_all"]["keys"] == 2
    assert sticky["light_all"]["weighted"] == pytest.approx(6 / 7)
    # p0 and p3 queued; light-0's home p2 never did.
    assert sticky["light_never_queued"]["keys"] == 1
    spill = figures["spill_reaction_s"]
    assert spill["episodes"] == 1 and spill["spilled"] == 1 and spill["unspilled"] == 0
    assert spill["median"] == pytest.approx(0.3)
    assert spill["stayed_max_s"] == pytest.approx(0.1)
    assert spill["decision_median"] == pytest.approx(0.2) and spill["undecided"] == 0
    assert spill["short_episodes"] == 1


def test_an_episode_the_key_never_leaves_is_unspilled() -> None:
    users = ["user-heavy-0"] * 3
    sent = [(1.0, "p0"), (2.5, "p0"), (4.0, "p1")]
    episodes = [QueueEpisode("p0", START + 2.0, START + 3.0)]
    spill = key_figures(trace_of(users), replay_of(sent), episodes=episodes)["spill_reaction_s"]
    assert spill["episodes"] == 1 and spill["spilled"] == 0 and spill["median"] is None
    assert spill["idle"] == 0 and spill["unspilled"] == 1
    assert spill["unspilled_longest_s"] == pytest.approx(1.0)
    assert spill["stayed_max_s"] == pytest.approx(0.5)


def test_seeds_merge_to_the_worst_extremes_the_summed_counts_and_the_median() -> None:
    seeds = [
        {"light": {"min": 0.9, "median": 1.0, "keys": 10}, "max": 0.2, "home": "p0"},
        {"light": {"min": 0.8, "median": 0.96, "keys": 12}, "max": 0.5, "home": "p1"},
        {"light": {"min": None, "median": 0.9, "keys": 11}, "max": None, "home": "p2"},
    ]
    assert _merge_nested(seeds) == {
        "light": {"min": 0.8, "median": 0.96, "keys": 33},
        "max": 0.5,
        "home": "p0",
    }


def test_group_homes_count_each_pods_groups_and_the_requests_off_home() -> None:
    """Group 0 lives on p0 (one request of it strayed to p1), group 1 on p0, group 2 on
    p1; p2 is home to none and served nothing. The first request is in the warm-up."""
    groups: list[int | None] = [2, 0, 0, 0, 1, 1, 2, None]
    pods = ["p1", "p0", "p1", "p0", "p0", "p0", "p1", "p2"]
    sent = [(float(i), pod) for i, pod in enumerate(pods)]
    figures = group_homes(
        trace_of([None] * len(groups), groups),
        replay_of(sent),
        pods=["p0", "p1", "p2"],
        warmup_s=0.5,
    )
    assert figures == {
        "groups_per_pod": [2, 1, 0],
        "requests_per_pod": [4, 2, 0],
        "requests_max_over_mean": pytest.approx(2.0),
        "off_home_requests": 1,
    }


def test_seeds_merge_lists_item_by_item() -> None:
    seeds = [{"groups_per_pod": [10, 6, 6, 10]}, {"groups_per_pod": [11, 9, 7, 5]}, None]
    assert _merge_nested(seeds) == {"groups_per_pod": [10.5, 7.5, 6.5, 7.5]}


def test_hot_keys_heaviest_user_alone_exceeds_one_pod() -> None:
    scenario = build_scenario("h", duration_s=16)
    users = scenario.trace.users
    assert users is not None and scenario.session_affinity
    assert len(scenario.pods) == 4 and len({p.profile for p in scenario.pods}) == 1
    assert scenario.trace.rate_per_s == pytest.approx(0.6 * scenario.capacity_requests_per_s)
    trace = generate_trace(scenario.trace, seed=1)
    heavy = [r for r in trace.requests if r.user and r.user.startswith("user-heavy-")]
    assert len(heavy) / len(trace.requests) == pytest.approx(0.4, abs=0.05)
    # The heaviest user's share of the work, with its prefix always cached, over a pod's
    # share of the offered work (60% of 4 pods: a pod is 1/2.4 of it).
    profile = scenario.pods[0].profile

    def cost(prompt: int, output: int) -> float:
        capacity = nominal_capacity(profile, prompt_tokens=prompt, output_tokens=output)
        return 1 / capacity.requests_per_s

    total = sum(cost(r.prompt_words, r.max_tokens) for r in trace.requests)
    heaviest = sum(
        cost(r.prompt_words - users.prefix_words, r.max_tokens)
        for r in heavy
        if r.user == "user-heavy-0"
    )
    assert heaviest / total > 1 / 2.4


def test_keys_of_calm_pods_are_homed_where_the_ring_put_them() -> None:
    """light-0 hashes to p0, which spills from 2.0 to 5.0: its requests then go to p1,
    the most-used pod, so "most used" calls it a key of unloaded p1 at 1/4. By the
    server's decisions it is p0's key, and p0 spilled: not a key of a calm pod. light-1
    lives on p1 and never moves: 100%."""
    users = ["user-heavy-0"] * 2 + ["user-light-0"] * 4 + ["user-light-1"] * 3
    sent = [
        (1.0, "p2"),
        (6.0, "p2"),
        (1.0, "p0"),
        (2.5, "p1"),
        (3.5, "p1"),
        (4.5, "p1"),
        (1.5, "p1"),
        (3.0, "p1"),
        (5.5, "p1"),
    ]
    spilled = [(START + t, pods) for t, pods in ((0.5, set()), (2.0, {"p0"}), (5.0, set()))]
    figures = key_figures(trace_of(users), replay_of(sent), episodes=[], spilled=spilled)
    sticky = figures["key_stickiness"]
    assert sticky["light_unloaded"]["keys"] == 2
    assert sticky["light_unloaded"]["weighted"] == pytest.approx(6 / 7)
    assert sticky["light_calm"] == {
        "keys": 1,
        "requests": 3,
        "weighted": 1.0,
        "median": 1.0,
        "min": 1.0,
    }
    without = key_figures(trace_of(users), replay_of(sent), episodes=[])
    assert "light_calm" not in without["key_stickiness"]
