"""What a trace should look like: arrival rate and burstiness, request shapes and mix.

A `TraceSpec` is the scenario's whole description of its traffic, validated strictly
(unknown keys are errors, like the routing config) because a scenario that silently ran
with a default is a wasted benchmark. With a seed it determines a trace exactly
(`trace.generate_trace`), and it is stored in the trace file's header, so a saved trace
says what it was made from. Pure: models and arithmetic only.

The arrival rate is piecewise linear in time: a base rate, changed by `phases` (steps, or
a linear ramp between the phase points) and multiplied inside scheduled `bursts`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

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
    "RequestClass",
    "Sessions",
    "TraceSpec",
    "Uniform",
    "Users",
]

Band = Literal["critical", "standard", "sheddable"]
# Flow-control bands, most important first.
BANDS: tuple[Band, ...] = ("critical", "standard", "sheddable")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- lengths -------------------------------------------------------------------------------


class Constant(_Strict):
    """Always `value` words (or tokens)."""

    kind: Literal["constant"] = "constant"
    value: Annotated[int, Field(ge=1)]

    def sample(self, rng: random.Random) -> int:
        return self.value


class Uniform(_Strict):
    """An integer drawn uniformly from [low, high], both included."""

    kind: Literal["uniform"] = "uniform"
    low: Annotated[int, Field(ge=1)]
    high: Annotated[int, Field(ge=1)]

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        return self

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


class LogNormal(_Strict):
    """A lognormal length, rounded and clipped to [min, max].

    `mean` is the arithmetic mean of the unclipped distribution (what people quote as "mean
    prompt length"), not the mean of its logarithm; `sigma` is the standard deviation of the
    logarithm (0.5 is moderately skewed, 1.0 heavy-tailed). Clipping moves the realised
    mean a little; `Trace.summary()` reports the realised one.
    """

    kind: Literal["lognormal"] = "lognormal"
    mean: Annotated[float, Field(gt=0)]
    sigma: Annotated[float, Field(ge=0, le=4)]
    min: Annotated[int, Field(ge=1)] = 1
    max: Annotated[int, Field(ge=1)] = 1_000_000

    @model_validator(mode="after")
    def _ordered(self) -> LogNormal:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma * self.sigma / 2
        value = round(rng.lognormvariate(mu, self.sigma))
        return min(self.max, max(self.min, value))


def _constant_from_int(value: Any) -> Any:
    # In a JSON or YAML scenario file a bare integer is a constant length (`prompt_words:
    # 256`); Python code writes `Constant(value=256)`, which is what the type checker knows.
    if isinstance(value, int) and not isinstance(value, bool):
        return {"kind": "constant", "value": value}
    return value


LengthDistribution = Annotated[
    Constant | Uniform | LogNormal,
    Field(discriminator="kind"),
    BeforeValidator(_constant_from_int),
]


# -- the spec ------------------------------------------------------------------------------


class RequestClass(_Strict):
    """One request shape of the mix, chosen with probability proportional to `weight`.

    `prompt_words` is the request's own text (the question); a prefix group's shared prefix
    and a conversation's earlier turns come in front of it.
    """

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    weight: Annotated[float, Field(gt=0)] = 1.0
    prompt_words: LengthDistribution
    output_tokens: LengthDistribution


class Burst(_Strict):
    """The arrival rate is multiplied by `multiplier` during [start_s, start_s + duration_s)."""

    start_s: Annotated[float, Field(ge=0)]
    duration_s: Annotated[float, Field(gt=0)]
    multiplier: Annotated[float, Field(gt=0)]


class Phase(_Strict):
    """From `start_s` on, the base rate is `rate_per_s` (or ramps towards it; see `ramp`)."""

    start_s: Annotated[float, Field(ge=0)]
    rate_per_s: Annotated[float, Field(ge=0)]


class PrefixGroups(_Strict):
    """`groups` shared prompts of `prefix_words` each (a system prompt, a long document).

    A `fraction` of requests belongs to a group, chosen uniformly; its prompt is the group's
    prefix followed by the request's own words.
    """

    groups: Annotated[int, Field(ge=1)]
    prefix_words: Annotated[int, Field(ge=1)]
    fraction: Annotated[float, Field(ge=0, le=1)] = 1.0


class Lora(_Strict):
    """LoRA adapters with Zipf-like popularity: adapter k (from 1) has weight 1 / k**zipf_s.

    A `fraction` of requests uses an adapter; such a request's `model` is the adapter's name
    (as vLLM serves adapters). `zipf_s = 0` makes all adapters equally popular.
    """

    adapters: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], Field(min_length=1)]
    zipf_s: Annotated[float, Field(ge=0)] = 1.0
    fraction: Annotated[float, Field(ge=0, le=1)] = 1.0

    @field_validator("adapters")
    @classmethod
    def _unique(cls, adapters: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(adapters)) != len(adapters):
            raise ValueError("adapter names must be unique")
        return adapters


class BandMix(_Strict):
    """Relative weights of the flow-control bands (all standard by default)."""

    critical: Annotated[float, Field(ge=0)] = 0.0
    standard: Annotated[float, Field(ge=0)] = 1.0
    sheddable: Annotated[float, Field(ge=0)] = 0.0

    @model_validator(mode="after")
    def _some_weight(self) -> BandMix:
        if self.critical + self.standard + self.sheddable <= 0:
            raise ValueError("at least one band needs a positive weight")
        return self

    def weights(self) -> tuple[float, ...]:
        """The weights in `BANDS` order."""
        return (self.critical, self.standard, self.sheddable)


class Sessions(_Strict):
    """Multi-turn conversations, `conversations` of them open at any time.

    Each request continues a randomly chosen open conversation (or opens one in an empty
    slot); after `turns` turns a conversation ends and a new one takes its slot. Every turn
    carries the conversation's session key, and its prompt is the previous turn's prompt,
    words standing for the previous reply (`max_tokens` of them), then the new question:
    the context grows as in a chat, and each follow-up shares its conversation's prefix.
    The reply placeholders are not what the pod generated, so a prefix cache hits on the
    earlier prompts only. A conversation keeps its prefix group, adapter and band. The
    trace is open loop: a follow-up may be sent before the previous turn has finished.
    """

    conversations: Annotated[int, Field(ge=1)]
    turns: Annotated[int, Field(ge=1)]


class Users(_Strict):
    """Who sends each request, in the body's `user` field: a few heavy users and many light
    ones (hot session keys).

    A request of a class named in `heavy_classes` belongs to a heavy user, `user-heavy-<k>`
    with probability proportional to `heavy[k]`; any other request belongs, with
    probability `light_fraction`, to one of `light` light users (`user-light-<k>`, chosen
    uniformly), and otherwise to nobody (no `user`). Every request of a user starts with
    that user's own `prefix_words` words (its system prompt and context), so a pod that
    served the user before has them in its prefix cache.
    """

    heavy: tuple[Annotated[float, Field(gt=0)], ...] = ()
    heavy_classes: tuple[str, ...] = ()
    light: Annotated[int, Field(ge=0)] = 0
    light_fraction: Annotated[float, Field(ge=0, le=1)] = 0.0
    prefix_words: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _consistent(self) -> Users:
        if bool(self.heavy) != bool(self.heavy_classes):
            raise ValueError("heavy users need heavy_classes, and heavy_classes heavy users")
        if self.light_fraction > 0 and self.light == 0:
            raise ValueError("light_fraction above 0 needs light users")
        return self


def _default_classes() -> tuple[RequestClass, ...]:
    return (
        RequestClass(
            name="default", prompt_words=Constant(value=128), output_tokens=Constant(value=64)
        ),
    )


class TraceSpec(_Strict):
    """Everything that shapes a trace; with a seed it determines the trace exactly.

    The arrival rate at time t is `rate_per_s`, replaced from each `Phase.start_s` on by the
    phase's rate (stepwise, or with `ramp` linearly interpolated between the points
    (0, rate_per_s), (phase.start_s, phase.rate_per_s), ... and flat after the last one),
    times the multiplier of every `Burst` covering t. `arrivals="gamma"` draws gaps with
    coefficient of variation `burstiness_cv` (above 1 is burstier than Poisson, below 1
    more regular; the mean rate is unchanged); Poisson is gamma with cv 1.
    """

    duration_s: Annotated[float, Field(gt=0)]
    rate_per_s: Annotated[float, Field(ge=0)]
    arrivals: Literal["poisson", "gamma"] = "poisson"
    burstiness_cv: Annotated[float, Field(gt=0, le=20)] = 1.0
    bursts: tuple[Burst, ...] = ()
    phases: tuple[Phase, ...] = ()
    ramp: bool = False
    request_classes: Annotated[tuple[RequestClass, ...], Field(min_length=1)] = Field(
        default_factory=_default_classes
    )
    prefix_groups: PrefixGroups | None = None
    lora: Lora | None = None
    bands: BandMix = BandMix()
    sessions: Sessions | None = None
    users: Users | None = None
    # The simulated pods' default base model (`llm_sim.pod.DEFAULT_MODEL`).
    model: Annotated[str, Field(min_length=1)] = "meta-llama/Llama-3.1-8B-Instruct"
    stream: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> TraceSpec:
        if self.arrivals == "poisson" and self.burstiness_cv != 1.0:
            raise ValueError("burstiness_cv applies to arrivals='gamma' (Poisson has cv 1)")
        starts = [p.start_s for p in self.phases]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError("phases must have strictly increasing start_s")
        names = [c.name for c in self.request_classes]
        if len(set(names)) != len(names):
            raise ValueError("request class names must be unique")
        if self.lora is not None and self.model in self.lora.adapters:
            raise ValueError(f"adapter {self.model!r} has the base model's name")
        if self.users is not None:
            if self.sessions is not None:
                raise ValueError("users and sessions both set `user`: choose one")
            unknown = set(self.users.heavy_classes) - set(names)
            if unknown:
                raise ValueError(f"users.heavy_classes names unknown classes: {sorted(unknown)}")
        return self

    def rate_at(self, t: float) -> float:
        """The arrival rate (requests per second) at `t` seconds into the trace."""
        return self._base_rate(t, before=False) * self._multiplier(t)

    def rate_pieces(self) -> list[tuple[float, float, float, float]]:
        """(t0, t1, rate at t0, rate just before t1) for each stretch of [0, duration_s)
        where the rate is linear and not zero: what arrival generation integrates."""
        cuts = {0.0, self.duration_s}
        cuts.update(p.start_s for p in self.phases)
        for burst in self.bursts:
            cuts.update((burst.start_s, burst.start_s + burst.duration_s))
        edges = sorted(c for c in cuts if 0 <= c <= self.duration_s)
        pieces: list[tuple[float, float, float, float]] = []
        for t0, t1 in itertools.pairwise(edges):
            m = self._multiplier((t0 + t1) / 2)
            r0 = self._base_rate(t0, before=False) * m
            r1 = self._base_rate(t1, before=True) * m
            if r0 > 0 or r1 > 0:
                pieces.append((t0, t1, r0, r1))
        return pieces

    def _base_rate(self, t: float, *, before: bool) -> float:
        """The base rate at t (just before t when `before`, for a segment's right end)."""
        points = [(0.0, self.rate_per_s)] + [(p.start_s, p.rate_per_s) for p in self.phases]
        starts = [s for s, _ in points]
        # The last point at or before t (strictly before when `before`): later duplicates at
        # 0 (a phase starting at 0) override the base rate.
        i = (bisect.bisect_left if before else bisect.bisect_right)(starts, t) - 1
        i = max(i, 0)
        start, rate = points[i]
        if not self.ramp or i + 1 >= len(points):
            return rate
        next_start, next_rate = points[i + 1]
        if next_start <= start:
            return next_rate
        return rate + (next_rate - rate) * (t - start) / (next_start - start)

    def _multiplier(self, t: float) -> float:
        m = 1.0
        for burst in self.bursts:
            if burst.start_s <= t < burst.start_s + burst.duration_s:
                m *= burst.multiplier
        return m
