"""Seeded request traces: the arrival times and request shapes every policy is measured on.

A benchmark compares balancing policies fairly only if each one sees exactly the same
traffic, so the trace is generated once, up front, from a `TraceSpec` and a seed, and then
replayed open loop (`replay.py`). Generation is a pure function: `random.Random` instances
seeded from the trace seed, never the global generator, never the clock. Each aspect
(arrivals, request shapes, prefix groups, adapters, bands, sessions, users) draws from its own
stream, seeded `"<seed>:<aspect>"`, so changing the band mix of a scenario leaves its
arrival times and prompt lengths untouched.

Arrivals are a renewal process in "operational time" mapped onto the wall clock through the
integrated rate (the time-rescaling theorem): gaps of mean 1 (exponential for Poisson, gamma
with the requested coefficient of variation otherwise) are laid along Λ(t) = ∫ rate, where
rate(t) is the base rate, optionally changed by `phases` (steps, or a linear ramp) and
multiplied inside scheduled `bursts`. So the mean rate is always rate(t), and the
burstiness is the gaps' coefficient of variation, locally.

Prompts are not stored. The simulated pods count one whitespace word as one token, so a
prompt is a list of parts (`PromptPart`: a kind, an owner and a word count) whose words are
derived from those three values, e.g. `g3w0 g3w1 ...` for prefix group 3 and `q17w0 ...`
for request 17's own question: the same group always yields the same leading words (a
prefix cache can hit), and no two requests' own words can collide.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from llm_sim.loadgen.errors import TraceFormatError
from llm_sim.loadgen.spec import (
    BANDS,
    Band,
    BandMix,
    Burst,
    Constant,
    LengthDistribution,
    LogNormal,
    Lora,
    Phase,
    PrefixGroups,
    RequestClass,
    Sessions,
    TraceSpec,
    Uniform,
    Users,
)
from llm_sim.loadgen.stats import percentile

# The spec's names are re-exported: a trace is used together with the spec it came from.
__all__ = [
    "BANDS",
    "Band",
    "BandMix",
    "Burst",
    "Constant",
    "LengthDistribution",
    "LogNormal",
    "Lora",
    "Phase",
    "PrefixGroups",
    "PromptPart",
    "RequestClass",
    "Sessions",
    "Trace",
    "TraceRequest",
    "TraceSpec",
    "TraceSummary",
    "Uniform",
    "Users",
    "generate_trace",
]

_FORMAT = "xds-server-trace"
_VERSION = 1


# -- the trace -----------------------------------------------------------------------------


class PromptPart(NamedTuple):
    """A run of `words` prompt words derived from (`kind`, `owner`).

    Kinds: "g" a prefix group's shared prefix (owner: the group), "u" a user's own prefix
    (owner: the user's number, heavy users first), "q" a request's own question and "a"
    the stand-in for a reply in a conversation's history (owner: the request index).
    """

    kind: str
    owner: int
    words: int


@functools.lru_cache(maxsize=4096)
def _part_text(part: PromptPart, salt: str) -> str:
    # Cached because group prefixes and conversation histories repeat across requests.
    stem = f"{salt}{part.kind}{part.owner}w"
    return " ".join(f"{stem}{j}" for j in range(part.words))


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    """One request of a trace, sent `at_s` seconds after the start of the replay.

    `prompt_words` is the prompt's length in words (= tokens for the simulated pods);
    `prompt_text()` builds the text. `session` and `turn` are None and 0 outside sessions;
    `adapter` and `prefix_group` are None when the request uses none; `user` is the body's
    `user` outside sessions (`TraceSpec.users`), None for nobody's.
    """

    index: int
    at_s: float
    model: str
    request_class: str
    prompt_words: int
    parts: tuple[PromptPart, ...]
    max_tokens: int
    adapter: str | None
    band: Band
    session: str | None
    turn: int
    prefix_group: int | None
    user: str | None = None

    def prompt_text(self, *, salt: str = "") -> str:
        """The prompt: `prompt_words` words, the same every time for the same `salt`.

        A non-empty `salt` prefixes every word, so a replay with a new salt shares no prefix
        with an earlier one (a warm prefix cache from a previous run then cannot help).
        """
        return " ".join(_part_text(part, salt) for part in self.parts)

    def to_json(self) -> dict[str, Any]:
        # `user` only when set: traces without users keep the bytes they always had.
        user = {} if self.user is None else {"user": self.user}
        return {
            **user,
            "index": self.index,
            "at_s": self.at_s,
            "model": self.model,
            "class": self.request_class,
            "prompt_words": self.prompt_words,
            "parts": [list(p) for p in self.parts],
            "max_tokens": self.max_tokens,
            "adapter": self.adapter,
            "band": self.band,
            "session": self.session,
            "turn": self.turn,
            "prefix_group": self.prefix_group,
        }

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> TraceRequest:
        """Raises KeyError, TypeError or ValueError on a malformed document."""
        parts = tuple(PromptPart(str(k), int(o), int(w)) for k, o, w in document["parts"])
        band = document["band"]
        if band not in BANDS:
            raise ValueError(f"unknown band {band!r}")
        request = cls(
            index=int(document["index"]),
            at_s=float(document["at_s"]),
            model=str(document["model"]),
            request_class=str(document["class"]),
            prompt_words=int(document["prompt_words"]),
            parts=parts,
            max_tokens=int(document["max_tokens"]),
            adapter=_optional_str(document["adapter"]),
            band=band,
            session=_optional_str(document["session"]),
            turn=int(document["turn"]),
            prefix_group=_optional_int(document["prefix_group"]),
            user=_optional_str(document.get("user")),
        )
        if request.prompt_words != sum(p.words for p in parts):
            raise ValueError("prompt_words does not match the parts")
        return request


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, kw_only=True)
class TraceSummary:
    """What a trace contains, to check a scenario before spending minutes replaying it."""

    requests: int
    duration_s: float
    mean_rate_per_s: float
    prompt_words_mean: float
    prompt_words_p50: float | None
    prompt_words_p99: float | None
    prompt_words_max: int
    output_tokens_mean: float
    output_tokens_p50: float | None
    output_tokens_max: int
    in_prefix_group: float
    sessions: int
    by_class: dict[str, int] = field(default_factory=dict)
    by_band: dict[str, int] = field(default_factory=dict)
    by_adapter: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "duration_s": self.duration_s,
            "mean_rate_per_s": self.mean_rate_per_s,
            "prompt_words_mean": self.prompt_words_mean,
            "prompt_words_p50": self.prompt_words_p50,
            "prompt_words_p99": self.prompt_words_p99,
            "prompt_words_max": self.prompt_words_max,
            "output_tokens_mean": self.output_tokens_mean,
            "output_tokens_p50": self.output_tokens_p50,
            "output_tokens_max": self.output_tokens_max,
            "in_prefix_group": self.in_prefix_group,
            "sessions": self.sessions,
            "by_class": dict(self.by_class),
            "by_band": dict(self.by_band),
            "by_adapter": dict(self.by_adapter),
        }


@dataclass(frozen=True, kw_only=True)
class Trace:
    """A generated trace: the spec and seed it came from, and its requests in time order.

    Saved as JSON lines: a header line (format, version, seed, spec, request count), then
    one line per request, keys sorted and without spaces, so the same trace always saves to
    the same bytes.
    """

    spec: TraceSpec
    seed: int
    requests: tuple[TraceRequest, ...]

    def to_jsonl(self) -> str:
        header = {
            "format": _FORMAT,
            "version": _VERSION,
            "seed": self.seed,
            "requests": len(self.requests),
            "spec": self.spec.model_dump(mode="json"),
        }
        lines = [_dumps(header)] + [_dumps(r.to_json()) for r in self.requests]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_jsonl(cls, text: str, *, source: str = "trace") -> Trace:
        """Parse what `to_jsonl` wrote; raises TraceFormatError naming the bad line."""
        lines = text.splitlines()
        if not lines:
            raise TraceFormatError(f"{source}: empty")
        try:
            header = json.loads(lines[0])
        except ValueError as exc:
            raise TraceFormatError(f"{source}:1: the header is not JSON: {exc}") from exc
        if not isinstance(header, dict) or header.get("format") != _FORMAT:
            raise TraceFormatError(f"{source}:1: not a trace (format is not {_FORMAT!r})")
        if header.get("version") != _VERSION:
            raise TraceFormatError(
                f"{source}:1: trace version {header.get('version')!r}, expected {_VERSION}"
            )
        try:
            spec = TraceSpec.model_validate(header["spec"])
            seed = int(header["seed"])
            expected = int(header["requests"])
        except (KeyError, TypeError, ValueError, ValidationError) as exc:
            raise TraceFormatError(f"{source}:1: bad header: {exc}") from exc
        requests: list[TraceRequest] = []
        for number, line in enumerate(lines[1:], start=2):
            try:
                request = TraceRequest.from_json(json.loads(line))
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{source}:{number}: bad request: {exc!r}") from exc
            if request.index != len(requests):
                raise TraceFormatError(
                    f"{source}:{number}: request index {request.index}, expected {len(requests)}"
                )
            requests.append(request)
        if len(requests) != expected:
            raise TraceFormatError(
                f"{source}: the header announces {expected} requests, found {len(requests)}"
            )
        return cls(spec=spec, seed=seed, requests=tuple(requests))

    def save(self, path: Path) -> None:
        """Write the trace to `path` (JSON lines, UTF-8)."""
        path.write_text(self.to_jsonl(), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Trace:
        """Read a trace written by `save`; raises TraceFormatError."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TraceFormatError(f"{path}: cannot read: {exc.strerror}") from exc
        return cls.from_jsonl(text, source=str(path))

    def summary(self) -> TraceSummary:
        requests = self.requests
        n = len(requests)
        prompts = [float(r.prompt_words) for r in requests]
        outputs = [float(r.max_tokens) for r in requests]
        return TraceSummary(
            requests=n,
            duration_s=self.spec.duration_s,
            mean_rate_per_s=n / self.spec.duration_s,
            prompt_words_mean=sum(prompts) / n if n else 0.0,
            prompt_words_p50=percentile(prompts, 50),
            prompt_words_p99=percentile(prompts, 99),
            prompt_words_max=max((r.prompt_words for r in requests), default=0),
            output_tokens_mean=sum(outputs) / n if n else 0.0,
            output_tokens_p50=percentile(outputs, 50),
            output_tokens_max=max((r.max_tokens for r in requests), default=0),
            in_prefix_group=(
                sum(1 for r in requests if r.prefix_group is not None) / n if n else 0.0
            ),
            sessions=len({r.session for r in requests if r.session is not None}),
            by_class=dict(sorted(Counter(r.request_class for r in requests).items())),
            by_band={b: c for b in BANDS if (c := sum(1 for r in requests if r.band == b))},
            by_adapter=dict(
                sorted(Counter(r.adapter for r in requests if r.adapter is not None).items())
            ),
        )


def _dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# -- generation ----------------------------------------------------------------------------


def generate_trace(spec: TraceSpec, *, seed: int) -> Trace:
    """The trace `spec` describes, for `seed`: the same pair always gives the same trace."""
    times = _arrival_times(spec, random.Random(f"{seed}:arrivals"))
    shapes = random.Random(f"{seed}:shapes")
    draws = _Draws(spec, seed=seed)
    classes = spec.request_classes
    class_cum = list(itertools.accumulate(c.weight for c in classes))
    slots: list[_Conversation | None] = [None] * (
        spec.sessions.conversations if spec.sessions else 0
    )
    conversation_ids = itertools.count()
    requests: list[TraceRequest] = []
    for index, at in enumerate(times):
        shape = shapes.choices(classes, cum_weights=class_cum)[0]
        question = PromptPart("q", index, shape.prompt_words.sample(shapes))
        max_tokens = shape.output_tokens.sample(shapes)
        session: str | None = None
        turn = 0
        user, user_prefix = draws.user(shape.name)
        if spec.sessions is None:
            group, adapter, band = draws.attributes()
            history = (*user_prefix, *_group_prefix(spec, group))
        else:
            slot = draws.sessions.randrange(len(slots))
            conversation = slots[slot]
            if conversation is None:
                conversation = _Conversation.open(next(conversation_ids), spec, draws)
            group, adapter, band = conversation.group, conversation.adapter, conversation.band
            history = conversation.history
            session = conversation.session
            turn = conversation.turns + 1
            conversation.advance(question, PromptPart("a", index, max_tokens))
            slots[slot] = None if conversation.turns >= spec.sessions.turns else conversation
        parts = (*history, question)
        requests.append(
            TraceRequest(
                index=index,
                at_s=at,
                model=spec.model if adapter is None else adapter,
                request_class=shape.name,
                prompt_words=sum(p.words for p in parts),
                parts=parts,
                max_tokens=max_tokens,
                adapter=adapter,
                band=band,
                session=session,
                turn=turn,
                prefix_group=group,
                user=user,
            )
        )
    return Trace(spec=spec, seed=seed, requests=tuple(requests))


def _group_prefix(spec: TraceSpec, group: int | None) -> tuple[PromptPart, ...]:
    if group is None or spec.prefix_groups is None:
        return ()
    return (PromptPart("g", group, spec.prefix_groups.prefix_words),)


class _Draws:
    """The per-aspect random streams and the precomputed weights they choose with."""

    def __init__(self, spec: TraceSpec, *, seed: int) -> None:
        self.spec = spec
        self.groups = random.Random(f"{seed}:prefix_groups")
        self.lora = random.Random(f"{seed}:lora")
        self.bands = random.Random(f"{seed}:bands")
        self.sessions = random.Random(f"{seed}:sessions")
        self.users = random.Random(f"{seed}:users")
        self.band_cum = list(itertools.accumulate(spec.bands.weights()))
        self.adapter_cum: list[float] = []
        if spec.lora is not None:
            zipf = [1.0 / (k**spec.lora.zipf_s) for k in range(1, len(spec.lora.adapters) + 1)]
            self.adapter_cum = list(itertools.accumulate(zipf))
        self.heavy_cum: list[float] = []
        if spec.users is not None and spec.users.heavy:
            self.heavy_cum = list(itertools.accumulate(spec.users.heavy))

    def attributes(self) -> tuple[int | None, str | None, Band]:
        """A prefix group (or None), an adapter (or None) and a band for a new request."""
        spec = self.spec
        group: int | None = None
        if spec.prefix_groups is not None:
            # Both draws always happen, so the stream stays aligned whatever the fraction.
            member = self.groups.random() < spec.prefix_groups.fraction
            which = self.groups.randrange(spec.prefix_groups.groups)
            group = which if member else None
        adapter: str | None = None
        if spec.lora is not None:
            uses = self.lora.random() < spec.lora.fraction
            which_adapter = self.lora.choices(spec.lora.adapters, cum_weights=self.adapter_cum)[0]
            adapter = which_adapter if uses else None
        band = self.bands.choices(BANDS, cum_weights=self.band_cum)[0]
        return group, adapter, band

    def user(self, request_class: str) -> tuple[str | None, tuple[PromptPart, ...]]:
        """The user of a new request of `request_class` (None: nobody) and its prefix."""
        users = self.spec.users
        if users is None:
            return None, ()
        number: int | None = None
        if request_class in users.heavy_classes:
            number = self.users.choices(range(len(users.heavy)), cum_weights=self.heavy_cum)[0]
            name = f"user-heavy-{number}"
        else:
            # Both draws always happen, so the stream stays aligned whatever the fraction.
            member = self.users.random() < users.light_fraction
            which = self.users.randrange(users.light) if users.light else 0
            if member:
                number = len(users.heavy) + which
                name = f"user-light-{which}"
        if number is None:
            return None, ()
        prefix = (PromptPart("u", number, users.prefix_words),) if users.prefix_words else ()
        return name, prefix


@dataclass(kw_only=True)
class _Conversation:
    """An open conversation during generation. Mutable state: `history` and `turns`."""

    session: str
    group: int | None
    adapter: str | None
    band: Band
    history: tuple[PromptPart, ...]
    turns: int = 0

    @classmethod
    def open(cls, number: int, spec: TraceSpec, draws: _Draws) -> _Conversation:
        group, adapter, band = draws.attributes()
        return cls(
            session=f"session-{number}",
            group=group,
            adapter=adapter,
            band=band,
            history=_group_prefix(spec, group),
        )

    def advance(self, question: PromptPart, reply: PromptPart) -> None:
        self.history = (*self.history, question, reply)
        self.turns += 1


def _arrival_times(spec: TraceSpec, rng: random.Random) -> list[float]:
    """Arrival offsets in [0, duration_s), rounded to the microsecond, in order."""
    if spec.arrivals == "gamma":
        shape = 1.0 / (spec.burstiness_cv**2)

        def gap() -> float:
            return rng.gammavariate(shape, 1.0 / shape)
    else:

        def gap() -> float:
            return rng.expovariate(1.0)

    times: list[float] = []
    area_before = 0.0
    u = gap()
    for t0, t1, r0, r1 in spec.rate_pieces():
        length = t1 - t0
        area = (r0 + r1) / 2 * length
        # Invert the integrated rate inside the segment, where rate(t0 + x) = r0 + b x:
        # r0 x + b x²/2 = y, solved in the form that is stable as b -> 0.
        b = (r1 - r0) / length
        while u < area_before + area:
            y = u - area_before
            x = 2 * y / (r0 + math.sqrt(max(r0 * r0 + 2 * b * y, 0.0)))
            times.append(round(t0 + min(x, length), 6))
            u += gap()
        area_before += area
    return [t for t in times if t < spec.duration_s]
