"""Traces: deterministic, with the arrival statistics and request mix the spec asks for."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from llm_sim.loadgen import (
    BandMix,
    Burst,
    Constant,
    LogNormal,
    Lora,
    Phase,
    PrefixGroups,
    RequestClass,
    Sessions,
    Trace,
    TraceFormatError,
    TraceSpec,
    Uniform,
    Users,
    generate_trace,
)

MIXED = TraceSpec(
    duration_s=30,
    rate_per_s=20,
    arrivals="gamma",
    burstiness_cv=2.0,
    bursts=(Burst(start_s=10, duration_s=2, multiplier=4),),
    request_classes=(
        RequestClass(
            name="chat",
            weight=3,
            prompt_words=LogNormal(mean=200, sigma=0.6, min=8, max=2000),
            output_tokens=Uniform(low=16, high=256),
        ),
        RequestClass(
            name="long", prompt_words=Constant(value=4000), output_tokens=Constant(value=64)
        ),
    ),
    prefix_groups=PrefixGroups(groups=4, prefix_words=32, fraction=0.5),
    lora=Lora(adapters=("sql", "chat-fr", "legal"), zipf_s=1.2, fraction=0.4),
    bands=BandMix(critical=1, standard=2, sheddable=1),
    sessions=Sessions(conversations=16, turns=4),
)


def gaps(trace: Trace) -> list[float]:
    return [b.at_s - a.at_s for a, b in itertools.pairwise(trace.requests)]


# -- determinism ---------------------------------------------------------------------------


def test_same_seed_same_trace_and_same_bytes(tmp_path: Path) -> None:
    first, second = generate_trace(MIXED, seed=7), generate_trace(MIXED, seed=7)
    assert first == second
    first.save(tmp_path / "a.jsonl")
    second.save(tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_different_seed_different_trace() -> None:
    first, second = generate_trace(MIXED, seed=7), generate_trace(MIXED, seed=8)
    assert [r.at_s for r in first.requests] != [r.at_s for r in second.requests]
    assert [r.prompt_words for r in first.requests] != [r.prompt_words for r in second.requests]


def test_save_load_round_trip_is_exact(tmp_path: Path) -> None:
    trace = generate_trace(MIXED, seed=3)
    path = tmp_path / "trace.jsonl"
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded == trace
    loaded.save(tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()
    header, first = path.read_text().splitlines()[:2]
    assert '"format":"xds-server-trace"' in header
    assert '"index":0' in first


def test_load_refuses_what_it_did_not_write(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    generate_trace(TraceSpec(duration_s=2, rate_per_s=5), seed=1).save(path)
    lines = path.read_text().splitlines()
    (tmp_path / "short.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(TraceFormatError, match="announces"):
        Trace.load(tmp_path / "short.jsonl")
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n{not json\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2"):
        Trace.load(tmp_path / "bad.jsonl")
    (tmp_path / "other.jsonl").write_text('{"format": "something else"}\n')
    with pytest.raises(TraceFormatError, match="not a trace"):
        Trace.load(tmp_path / "other.jsonl")
    with pytest.raises(TraceFormatError, match="cannot read"):
        Trace.load(tmp_path / "missing.jsonl")


def test_changing_one_aspect_keeps_the_others() -> None:
    base = generate_trace(MIXED, seed=5)
    other_bands = generate_trace(MIXED.model_copy(update={"bands": BandMix(standard=1)}), seed=5)
    assert [r.at_s for r in base.requests] == [r.at_s for r in other_bands.requests]
    assert [r.max_tokens for r in base.requests] == [r.max_tokens for r in other_bands.requests]
    assert {r.band for r in other_bands.requests} == {"standard"}


# -- arrivals ------------------------------------------------------------------------------


def test_poisson_mean_rate_and_cv() -> None:
    trace = generate_trace(TraceSpec(duration_s=200, rate_per_s=100), seed=11)
    assert len(trace.requests) == pytest.approx(20_000, rel=0.03)
    g = gaps(trace)
    assert statistics.pstdev(g) / statistics.mean(g) == pytest.approx(1.0, abs=0.05)
    times = [r.at_s for r in trace.requests]
    assert times == sorted(times)
    assert 0 <= times[0] and times[-1] < 200


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_cv_as_requested_and_mean_preserved(cv: float) -> None:
    spec = TraceSpec(duration_s=200, rate_per_s=100, arrivals="gamma", burstiness_cv=cv)
    trace = generate_trace(spec, seed=12)
    assert len(trace.requests) == pytest.approx(20_000, rel=0.1)
    g = gaps(trace)
    assert statistics.pstdev(g) / statistics.mean(g) == pytest.approx(cv, rel=0.15)


def test_bursts_raise_the_local_rate() -> None:
    spec = TraceSpec(
        duration_s=100, rate_per_s=50, bursts=(Burst(start_s=40, duration_s=10, multiplier=5),)
    )
    assert spec.rate_at(39.9) == 50 and spec.rate_at(45) == 250 and spec.rate_at(50) == 50
    times = [r.at_s for r in generate_trace(spec, seed=13).requests]
    inside = sum(1 for t in times if 40 <= t < 50) / 10
    outside = sum(1 for t in times if t < 40 or t >= 50) / 90
    assert inside == pytest.approx(250, rel=0.1)
    assert outside == pytest.approx(50, rel=0.1)


def test_phases_step_and_ramp() -> None:
    steps = TraceSpec(duration_s=60, rate_per_s=20, phases=(Phase(start_s=30, rate_per_s=80),))
    times = [r.at_s for r in generate_trace(steps, seed=14).requests]
    assert sum(1 for t in times if t < 30) / 30 == pytest.approx(20, rel=0.15)
    assert sum(1 for t in times if t >= 30) / 30 == pytest.approx(80, rel=0.1)

    ramp = steps.model_copy(update={"ramp": True})
    assert [ramp.rate_at(t) for t in (0, 15, 30, 59)] == [20, 50, 80, 80]
    times = [r.at_s for r in generate_trace(ramp, seed=14).requests]
    # ∫ rate over [0, 30) = 30 · (20 + 80) / 2; over [0, 15) = 15 · (20 + 50) / 2.
    assert sum(1 for t in times if t < 30) == pytest.approx(1500, rel=0.1)
    assert sum(1 for t in times if t < 15) == pytest.approx(525, rel=0.12)


def test_a_pause_phase_sends_nothing() -> None:
    spec = TraceSpec(
        duration_s=30,
        rate_per_s=50,
        phases=(Phase(start_s=10, rate_per_s=0), Phase(start_s=20, rate_per_s=50)),
    )
    times = [r.at_s for r in generate_trace(spec, seed=15).requests]
    assert not [t for t in times if 10 <= t < 20]
    assert len(times) == pytest.approx(1000, rel=0.15)


# -- request mix ---------------------------------------------------------------------------


def test_lengths_follow_their_distributions() -> None:
    spec = TraceSpec(
        duration_s=100,
        rate_per_s=50,
        request_classes=(
            RequestClass(
                name="chat",
                prompt_words=LogNormal(mean=300, sigma=0.5, min=10, max=100_000),
                output_tokens=Uniform(low=10, high=20),
            ),
            RequestClass(
                name="fixed",
                weight=0.25,
                prompt_words=Constant(value=7),
                output_tokens=Constant(value=3),
            ),
        ),
    )
    trace = generate_trace(spec, seed=16)
    chat = [r for r in trace.requests if r.request_class == "chat"]
    fixed = [r for r in trace.requests if r.request_class == "fixed"]
    assert len(fixed) / len(trace.requests) == pytest.approx(0.2, abs=0.02)
    assert statistics.mean(r.prompt_words for r in chat) == pytest.approx(300, rel=0.05)
    assert {r.max_tokens for r in chat} == set(range(10, 21))
    assert {(r.prompt_words, r.max_tokens) for r in fixed} == {(7, 3)}
    clipped = LogNormal(mean=100, sigma=2.0, min=50, max=60)
    trace = generate_trace(
        TraceSpec(
            duration_s=10,
            rate_per_s=50,
            request_classes=(
                RequestClass(name="c", prompt_words=clipped, output_tokens=Constant(value=1)),
            ),
        ),
        seed=1,
    )
    assert {r.prompt_words for r in trace.requests} <= set(range(50, 61))


def test_prompt_text_has_prompt_words_words() -> None:
    trace = generate_trace(MIXED, seed=17)
    for request in trace.requests[:200]:
        assert len(request.prompt_text().split()) == request.prompt_words


def test_shared_prefixes_within_a_group_and_distinct_across_groups() -> None:
    spec = TraceSpec(
        duration_s=20,
        rate_per_s=20,
        request_classes=(
            RequestClass(
                name="q", prompt_words=Constant(value=16), output_tokens=Constant(value=8)
            ),
        ),
        prefix_groups=PrefixGroups(groups=4, prefix_words=64, fraction=0.75),
    )
    trace = generate_trace(spec, seed=18)
    by_group: dict[int | None, list[list[str]]] = {}
    for request in trace.requests:
        by_group.setdefault(request.prefix_group, []).append(request.prompt_text().split())
    assert set(by_group) == {None, 0, 1, 2, 3}
    assert len(by_group[None]) / len(trace.requests) == pytest.approx(0.25, abs=0.05)
    prefixes = {}
    for group in range(4):
        heads = {tuple(words[:64]) for words in by_group[group]}
        assert len(heads) == 1, "every request of a group starts with the same 64 words"
        prefixes[group] = heads.pop()
    assert len({p[0] for p in prefixes.values()}) == 4, "groups differ from their first word"
    # The requests' own words never collide, with each other or with any prefix.
    own = [tuple(words[-16:]) for words in itertools.chain(*by_group.values())]
    assert len(set(own)) == len(own)
    own_words = [w for words in own for w in words]
    assert len(set(own_words)) == len(own_words)
    assert not set(own_words) & {w for p in prefixes.values() for w in p}


def test_salt_changes_every_word_but_keeps_sharing() -> None:
    spec = TraceSpec(
        duration_s=5,
        rate_per_s=10,
        prefix_groups=PrefixGroups(groups=1, prefix_words=10),
    )
    a, b = generate_trace(spec, seed=1).requests[:2]
    plain, salted = a.prompt_text().split(), a.prompt_text(salt="run2-").split()
    assert not set(plain) & set(salted)
    assert salted[:10] == b.prompt_text(salt="run2-").split()[:10]


def test_adapters_follow_zipf_skew() -> None:
    spec = TraceSpec(
        duration_s=100,
        rate_per_s=50,
        lora=Lora(adapters=("a0", "a1", "a2", "a3"), zipf_s=1.0, fraction=0.5),
    )
    trace = generate_trace(spec, seed=19)
    counts = Counter(r.adapter for r in trace.requests)
    assert counts[None] / len(trace.requests) == pytest.approx(0.5, abs=0.03)
    ranked = [counts[f"a{k}"] for k in range(4)]
    assert ranked == sorted(ranked, reverse=True)
    # 1 : 1/2 : 1/3 : 1/4
    assert ranked[0] / ranked[1] == pytest.approx(2, rel=0.15)
    assert ranked[0] / ranked[3] == pytest.approx(4, rel=0.2)
    for request in trace.requests:
        assert request.model == (request.adapter or spec.model)


def test_band_mix_proportions() -> None:
    spec = TraceSpec(
        duration_s=100, rate_per_s=50, bands=BandMix(critical=1, standard=3, sheddable=1)
    )
    trace = generate_trace(spec, seed=20)
    counts = Counter(r.band for r in trace.requests)
    n = len(trace.requests)
    assert counts["critical"] / n == pytest.approx(0.2, abs=0.02)
    assert counts["standard"] / n == pytest.approx(0.6, abs=0.02)
    assert counts["sheddable"] / n == pytest.approx(0.2, abs=0.02)
    assert trace.summary().by_band == dict(counts)


def test_sessions_share_their_conversation_prefix() -> None:
    spec = TraceSpec(
        duration_s=60,
        rate_per_s=10,
        sessions=Sessions(conversations=5, turns=3),
        prefix_groups=PrefixGroups(groups=2, prefix_words=20),
        lora=Lora(adapters=("x", "y")),
        bands=BandMix(critical=1, sheddable=1),
    )
    trace = generate_trace(spec, seed=21)
    conversations: dict[str, list[int]] = {}
    for request in trace.requests:
        assert request.session is not None
        conversations.setdefault(request.session, []).append(request.index)
    assert len(conversations) == pytest.approx(len(trace.requests) / 3, abs=6)
    for indices in conversations.values():
        turns = [trace.requests[i] for i in indices]
        assert [t.turn for t in turns] == list(range(1, len(turns) + 1))
        assert len(turns) <= 3
        assert len({(t.band, t.adapter, t.prefix_group) for t in turns}) == 1
        for earlier, later in itertools.pairwise(turns):
            before, after = earlier.prompt_text().split(), later.prompt_text().split()
            # The follow-up repeats the earlier prompt, then the reply's stand-in words.
            assert after[: len(before)] == before
            assert later.prompt_words == earlier.prompt_words + earlier.max_tokens + 128
    assert trace.summary().sessions == len(conversations)


def test_users_heavy_by_class_light_by_fraction_each_with_its_own_prefix() -> None:
    spec = TraceSpec(
        duration_s=100,
        rate_per_s=20,
        request_classes=(
            RequestClass(name="agent", weight=2, prompt_words=8, output_tokens=4),
            RequestClass(name="chat", weight=3, prompt_words=8, output_tokens=4),
        ),
        users=Users(
            heavy=(3, 1), heavy_classes=("agent",), light=10, light_fraction=0.5, prefix_words=6
        ),
    )
    trace = generate_trace(spec, seed=1)
    agents = [r for r in trace.requests if r.request_class == "agent"]
    chats = [r for r in trace.requests if r.request_class == "chat"]
    heavy = Counter(r.user for r in agents)
    assert set(heavy) == {"user-heavy-0", "user-heavy-1"}
    assert heavy["user-heavy-0"] / len(agents) == pytest.approx(0.75, abs=0.04)
    light = Counter(r.user for r in chats)
    assert light[None] / len(chats) == pytest.approx(0.5, abs=0.04)
    assert {u for u in light if u is not None} == {f"user-light-{k}" for k in range(10)}
    first_words: dict[str | None, set[str]] = {}
    for request in trace.requests:
        words = request.prompt_text().split()
        assert len(words) == request.prompt_words
        first_words.setdefault(request.user, set()).add(" ".join(words[:6]))
    # A user's requests share its prefix; different users' prefixes differ; nobody's have none.
    assert all(len(prefixes) == 1 for user, prefixes in first_words.items() if user)
    assert len({next(iter(p)) for u, p in first_words.items() if u}) == 12
    assert all(r.prompt_words == 8 for r in trace.requests if r.user is None)
    assert all(r.prompt_words == 14 for r in trace.requests if r.user is not None)
    # Users change neither arrivals nor shapes, and a trace without them keeps its bytes.
    plain = generate_trace(spec.model_copy(update={"users": None}), seed=1)
    assert [r.at_s for r in plain.requests] == [r.at_s for r in trace.requests]
    assert [r.max_tokens for r in plain.requests] == [r.max_tokens for r in trace.requests]
    assert '"user"' not in plain.to_jsonl().split("\n", 1)[1]
    assert Trace.from_jsonl(trace.to_jsonl()) == trace


def test_summary() -> None:
    trace = generate_trace(MIXED, seed=22)
    summary = trace.summary()
    assert summary.requests == len(trace.requests)
    assert summary.mean_rate_per_s == pytest.approx(len(trace.requests) / 30)
    assert set(summary.by_class) == {"chat", "long"}
    assert set(summary.by_adapter) <= {"sql", "chat-fr", "legal"}
    assert 0 < summary.in_prefix_group < 1
    assert summary.prompt_words_max >= 4000
    assert summary.to_json()["requests"] == summary.requests


def test_empty_trace() -> None:
    trace = generate_trace(TraceSpec(duration_s=10, rate_per_s=0), seed=1)
    assert trace.requests == ()
    assert trace.summary().requests == 0
    assert Trace.from_jsonl(trace.to_jsonl()) == trace


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"burstiness_cv": 2.0}, "arrivals='gamma'"),
        (
            {"phases": (Phase(start_s=5, rate_per_s=1), Phase(start_s=5, rate_per_s=2))},
            "increasing",
        ),
        ({"lora": Lora(adapters=("meta-llama/Llama-3.1-8B-Instruct",))}, "base model"),
        (
            {"sessions": Sessions(conversations=1, turns=1), "users": Users(light=1)},
            "choose one",
        ),
        ({"users": Users(heavy=(1,), heavy_classes=("nope",))}, "unknown classes"),
    ],
)
def test_inconsistent_specs_are_refused(update: dict[str, object], message: str) -> None:
    document = TraceSpec(duration_s=1, rate_per_s=1).model_dump() | update
    with pytest.raises(ValidationError, match=message):
        TraceSpec.model_validate(document)


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValidationError, match="above"):
        Uniform(low=5, high=4)
    with pytest.raises(ValidationError, match="above"):
        LogNormal(mean=5, sigma=1, min=10, max=2)
    with pytest.raises(ValidationError):
        Constant(value=0)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RequestClass.model_validate({"name": "x", "prompt_words": 0, "output_tokens": 1})


def test_a_bare_integer_in_a_document_is_a_constant_length() -> None:
    shape = RequestClass.model_validate({"name": "x", "prompt_words": 5, "output_tokens": 2})
    assert shape.prompt_words == Constant(value=5)
    assert shape.model_dump()["output_tokens"] == {"kind": "constant", "value": 2}
    with pytest.raises(ValidationError, match="extra"):
        TraceSpec.model_validate({"duration_s": 1, "rate_per_s": 1, "rate": 2})
