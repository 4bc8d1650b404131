"""The benchmark scenarios of DESIGN.md, as data: a fleet of simulated pods and a trace spec.

Arrival rates are set relative to the fleet's nominal capacity (`nominal_capacity` of each
pod's profile for the scenario's request mix), so a scenario means the same load whatever
the profiles' absolute speeds. `quick` shrinks the duration (and the fleet stays the same)
for a seconds-long smoke run.

Scenario g (faults) adds a schedule of failures to d's steady load (`Faults`): a pod
killed, another pod's requests reset before their first token, the killed pod back, and
the control plane killed and restarted, at fixed fractions of the run, so every policy
meets the same faults at the same point of the same trace.

Scenario h (hot keys) gives session affinity a few users too heavy for one pod: see
`_hot_keys` for its arithmetic, and bench/affinity.py for its figures.

Scenario f2 is f's fleet and trace through two server replicas that share their Envoys'
load (xds_server/peering), one Envoy on each (`Replicas`), with the trace's requests split
70/30 between the two Envoys: the fleet-wide budgets must hold whichever Envoy admits. Only
the project's policy runs (round robin and least request have no flow control to share).

Variants (`VARIANTS`, issue 35) are modest changes to some scenarios, for traffic the
routing was not tuned on: another GPU mix, more and longer prefixes, more adapters than
slots, another key skew, another burst shape. A variant names the scenarios it applies to
and, for each, what it changes (`Changes`); everything else is the scenario's own. Scenario
`c` under variant `more-prefixes` is named `c@more-prefixes`, and `build_scenario` takes
that name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.overload import Windows
from llm_sim.fleet import PodSpec
from llm_sim.loadgen.trace import (
    BandMix,
    Burst,
    LogNormal,
    Lora,
    Phase,
    PrefixGroups,
    RequestClass,
    TraceSpec,
    Users,
)
from llm_sim.profiles import A10G, H100, nominal_capacity

__all__ = [
    "ADAPTERS",
    "Changes",
    "Faults",
    "GrayFaults",
    "HOT_KEYS_HEAVY",
    "HOT_KEYS_LIGHT",
    "HOT_KEYS_LIGHT_FRACTION",
    "HOT_KEYS_PREFIX_WORDS",
    "MODEL",
    "Replicas",
    "SCENARIOS",
    "Scenario",
    "VARIANTS",
    "Variant",
    "build_scenario",
    "fleet_capacity",
    "pod_capacities",
    "scenario_names",
]

MODEL = "llama-3.1-8b"
ADAPTERS = tuple(f"adapter-{i}" for i in range(8))


@dataclass(frozen=True, kw_only=True)
class Faults:
    """When scenario g's faults happen, in seconds from the trace's start, and to whom.

    `kill_pod` is SIGKILLed at `kill_s` (its port refuses) and back, with a fresh engine,
    at `revive_s`; `reset_pod`'s requests without a first token have their connections
    reset at `reset_s`; the control plane is killed at `control_plane_s` and a new one
    starts on the same port `control_plane_down_s` later, as a restarted process would.
    """

    kill_pod: str
    kill_s: float
    reset_pod: str
    reset_s: float
    revive_s: float
    control_plane_s: float
    control_plane_down_s: float = 0.5


@dataclass(frozen=True, kw_only=True)
class GrayFaults:
    """Scenario g2's gray failures, in seconds from the trace's start (bench/gray.py):
    `wedge_pod` stops its streams after their first chunk from `wedge_s`, and is
    restarted at `unwedge_s`;
    `reset_pod` resets every request from `reset_s` to `reset_end_s`; `liar` claims
    `liar_factor` times its KV cache from `liar_s` to `liar_end_s`."""

    wedge_pod: str
    wedge_s: float
    unwedge_s: float
    reset_pod: str
    reset_s: float
    reset_end_s: float
    liar: str
    liar_s: float
    liar_end_s: float
    liar_factor: float = 4.0


@dataclass(frozen=True, kw_only=True)
class Replicas:
    """Scenario f2's gateway: one server replica per Envoy (`python -m xds_server run
    --replica NAME --peer ...`, each peering with all the others, on one config file), and
    the share of the trace's requests each Envoy gets (`split`, in replica order, summing
    to 1; which request goes where is decided by a seeded RNG: bench/split_replay.py)."""

    names: tuple[str, ...]
    split: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.split) or abs(sum(self.split) - 1) > 1e-9:
            raise ValueError(f"one share per replica, summing to 1: {self.names} {self.split}")


@dataclass(frozen=True, kw_only=True)
class Changes:
    """What a variant changes in one scenario; a field left at its default keeps the
    scenario's own. `title` says what changed (the variant's scenario title ends with it).

    `fleet` is pod kinds and counts (`("h100", 3), ("a10g", 1)`); `prefix_groups` and
    `prefix_words` shape c's shared prefixes; `adapters` is how many (named `adapter-<i>`,
    listed on every pod and in the pool) and `zipf_s` their popularity skew; `heavy` is h's
    heavy users' shares; `bursts` is (start, length, multiplier), start and length as
    fractions of the run, each at least 0.5 s long, as b's own bursts are.
    """

    title: str
    fleet: tuple[tuple[str, int], ...] = ()
    prefix_groups: int | None = None
    prefix_words: int | None = None
    adapters: int | None = None
    zipf_s: float | None = None
    heavy: tuple[float, ...] = ()
    bursts: tuple[tuple[float, float, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Variant:
    """A named set of changes to some scenarios (`changes`, by scenario name), and why
    its figures are what they are (`doc`, with the arithmetic)."""

    name: str
    doc: str
    changes: Mapping[str, Changes]

    @property
    def scenarios(self) -> tuple[str, ...]:
        return tuple(self.changes)


_GPU_MIX = Variant(
    name="gpu-mix",
    doc="""Another GPU mix: a with 1 H100-like + 3 A10G-like pods (instead of 2 + 2), d with
    3 H100-like + 1 A10G-like (instead of 4 H100-like). Rates stay at the scenario's share
    of the new fleet's nominal capacity (`fleet_capacity`): for 500-word chats an H100-like
    pod serves 4.62 requests/s and an A10G-like 0.36, so a's fleet goes from 9.95 to 5.68
    requests/s (Poisson at 65%: 3.69 requests/s) and one pod holds 81% of the capacity
    (two held 93%); d's goes from 18.5 to 14.2 requests/s (60%: 8.5), the A10G-like pod
    2.5% of it, and a request sent to it by turn, as round robin does, takes 13x as long.
    b is left out: its documents (10k-24k tokens) do not fit an A10G-like pod's KV cache
    (6,656 tokens), so that mix would measure which pod can serve a request at all, not
    balancing.""",
    changes={
        "a": Changes(title="1 H100-like + 3 A10G-like pods", fleet=(("h100", 1), ("a10g", 3))),
        "d": Changes(title="3 H100-like + 1 A10G-like pods", fleet=(("h100", 3), ("a10g", 1))),
    },
)

_MORE_PREFIXES = Variant(
    name="more-prefixes",
    doc="""c with 64 groups of 3,072-token prefixes (c: 32 of 2,048); the question is c's
    (256 words). The prefixes take 64 x 3,072 = 196,608 tokens, 2.5x one H100-like pod's
    KV cache (5,000 blocks of 16 = 80,000 tokens), as c96's 96 x 2,048 do: no pod keeps
    them all, a quarter of them (16 groups, 49,152 tokens, 61% of a pod) fits in each. The
    rate is c's 80% of the capacity without prefix hits, now for 3,328-word prompts: 4.65
    requests/s of 5.81 (c: 6.67 of 8.33), so a policy that scatters a group pays a
    3,072-token prefill (0.51 s at an H100-like pod's 6,000 tokens/s) each time it lands
    somewhere new.""",
    changes={
        "c": Changes(title="64 groups of 3,072-token prefixes", prefix_groups=64, prefix_words=3072)
    },
)

_FLAT_ADAPTERS = Variant(
    name="flat-adapters",
    doc="""e with 16 adapters (e: 8), every pod and the pool listing all 16, and Zipf
    s = 0.6 (e: 1.2). The pods keep 2 slots each, 8 in the fleet, for 16 adapters: at
    least half the adapters are out of every slot at any moment. Adapter k has weight
    k^-0.6: the hottest carries 17.5% of the adapter requests (e: 42.9%), the top two 29.0%
    (e: 61.5%), the top four 45.7% (e: 81.1%), the coldest 3.3%; 90% of requests name an
    adapter, as in e. No placement keeps every adapter with traffic in a slot, and a pod
    that keeps the hot ones takes more than its share unless others load them too.""",
    changes={"e": Changes(title="16 adapters for 8 slots, Zipf s = 0.6", adapters=16, zipf_s=0.6)},
)

_KEY_SKEW = Variant(
    name="key-skew",
    doc="""h with six lighter heavy users instead of three: their shares of the heavy
    requests are 30/20/15/15/10/10% (h: 64/22/14%). The heavy requests bring 1.85 pods of
    work as in h (`_hot_keys`), now 0.56/0.37/0.28/0.28/0.19/0.19 pods: none is over one
    pod alone, so what counts is where they live. Six keys on four pods put two or more
    on some pod: the heaviest two together with a pod's share of the light users (0.55 /
    4 = 0.14) make 1.07 pods, while spread by load every pod carries 0.6.""",
    changes={
        "h": Changes(
            title="6 heavy users at 30/20/15/15/10/10% of the heavy requests",
            heavy=(0.30, 0.20, 0.15, 0.15, 0.10, 0.10),
        )
    },
)

_BURST_SHAPE = Variant(
    name="burst-shape",
    doc="""b with two 1.9x bursts, each 15% of the run, at 25% and 60% (b: three 1.8x
    bursts of 10% at 20%, 50% and 75%): fewer, longer bursts at a higher multiplier. A
    burst takes the fleet from 50% to 95% of its capacity for 7.2 s of a 48 s run (b: 90%
    for 4.8 s); the extra work is about the same (2 x 0.15 x 0.9 = 0.27 of a run at base
    load, b's 3 x 0.1 x 0.8 = 0.24), so the mean load is 64% (b: 62%). d gets bursts too:
    two 1.5x bursts of 10% of the run at 30% and 70%, from 60% of the capacity to 90%
    (mean 66%); d's Poisson arrivals are unchanged otherwise.""",
    changes={
        "b": Changes(
            title="two 1.9x bursts of 15% of the run",
            bursts=((0.25, 0.15, 1.9), (0.6, 0.15, 1.9)),
        ),
        "d": Changes(
            title="two 1.5x bursts of 10% of the run",
            bursts=((0.3, 0.1, 1.5), (0.7, 0.1, 1.5)),
        ),
    },
)

VARIANTS: Mapping[str, Variant] = {
    v.name: v for v in (_GPU_MIX, _MORE_PREFIXES, _FLAT_ADAPTERS, _KEY_SKEW, _BURST_SHAPE)
}
_UNCHANGED = Changes(title="")


def scenario_names(scenarios: Sequence[str], variant: str | None) -> list[str]:
    """The run names of `scenarios` under `variant` (`c@more-prefixes`), or the scenarios
    themselves without one; a ValueError (with a full-sentence message) for an unknown
    variant or a scenario it does not apply to."""
    if variant is None:
        return list(scenarios)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}.")
    applies = VARIANTS[variant].scenarios
    others = [s for s in scenarios if s not in applies]
    if others:
        raise ValueError(
            f"variant {variant} applies to scenarios {', '.join(applies)} only, not to"
            f" {', '.join(others)}."
        )
    return [f"{s}@{variant}" for s in scenarios]


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    title: str
    pods: tuple[PodSpec, ...]
    trace: TraceSpec
    # Requests still running this long after the last arrival are cut off (and counted).
    drain_s: float
    capacity_requests_per_s: float
    # LoRA adapters the pods serve (and the pool config lists), and whether the project's
    # policy turns on session/prefix affinity (consistent hashing on prompt_cache_key).
    adapters: tuple[str, ...] = ()
    session_affinity: bool = False
    # Scenario f: the project's `flow_control` section, the policies that run (the oracle
    # has no admission), and the windows its figures are measured in.
    flow_control: Mapping[str, Any] | None = None
    policies: tuple[str, ...] | None = None
    windows: Windows | None = None
    # `balancing` settings of the project's policy in this scenario (the run's own
    # --project-balancing goes on top).
    project_balancing: Mapping[str, Any] | None = None
    # Figures count requests that arrive after this many seconds (and cache and adapter
    # counters from then on): the run's start is a cold start, not the steady state.
    warmup_s: float = 0.0
    # Scenario g: the fault schedule; g2: the gray failures'.
    faults: Faults | None = None
    gray: GrayFaults | None = None
    # Scenario f2: server replicas and Envoys, one each, and the trace's split over them.
    replicas: Replicas | None = None


def _pods(**counts: int) -> tuple[PodSpec, ...]:
    profiles = {"h100": H100, "a10g": A10G}
    return tuple(
        PodSpec(name=f"{kind}-{i}", profile=profiles[kind])
        for kind, n in counts.items()
        for i in range(n)
    )


def _fleet(changes: Changes, **counts: int) -> tuple[PodSpec, ...]:
    """The scenario's pods (`counts`, as for `_pods`), or the variant's fleet."""
    return _pods(**(dict(changes.fleet) or counts))


def _bursts(
    changes: Changes, duration_s: float, *default: tuple[float, float, float]
) -> tuple[Burst, ...]:
    """The scenario's bursts (`default`: start, length, multiplier; start and length as
    fractions of the run), or the variant's."""
    return tuple(
        Burst(start_s=duration_s * at, duration_s=max(0.5, duration_s * length), multiplier=m)
        for at, length, m in (changes.bursts or default)
    )


def _mean(distribution: object) -> int:
    mean = getattr(distribution, "mean", None) or getattr(distribution, "value", None)
    assert mean is not None, distribution
    return round(float(mean))


def fleet_capacity(pods: Sequence[PodSpec], classes: Sequence[RequestClass]) -> float:
    """Requests/s the fleet sustains for this mix: per pod, the weighted harmonic mean of the
    per-class capacities (time per request is additive), summed over pods."""
    total_weight = sum(c.weight for c in classes)
    capacity = 0.0
    for pod in pods:
        seconds_per_request = sum(
            (c.weight / total_weight)
            / nominal_capacity(
                pod.profile,
                prompt_tokens=_mean(c.prompt_words),
                output_tokens=_mean(c.output_tokens),
            ).requests_per_s
            for c in classes
        )
        capacity += 1 / seconds_per_request
    return capacity


def pod_capacities(scenario: Scenario) -> dict[str, float]:
    """Each pod's nominal requests/s for the scenario's request classes as the trace draws
    them (without shared prefixes or users' prefixes): what a pod's share of the requests
    is held against (bench/pooling.py `served_shares`)."""
    classes = scenario.trace.request_classes
    return {pod.name: fleet_capacity([pod], classes) for pod in scenario.pods}


# Scenario h's users: the heavy ones' shares of the heavy requests, how many light ones,
# the share of the other requests that carry a light user, and every user's own prefix.
HOT_KEYS_HEAVY = (0.64, 0.22, 0.14)
HOT_KEYS_LIGHT = 48
HOT_KEYS_LIGHT_FRACTION = 2 / 3
HOT_KEYS_PREFIX_WORDS = 256


def _hot_keys(
    duration_s: float,
    *,
    ln: Callable[..., LogNormal],
    request_scale: float,
    heavy_shares: tuple[float, ...] = HOT_KEYS_HEAVY,
) -> tuple[tuple[PodSpec, ...], TraceSpec, float]:
    """Scenario h's fleet, trace and capacity (requests/s).

    The issue asks for 4 identical pods at 60% load and 40% of requests from 3 heavy `user`
    values "whose demand alone exceeds one pod". Each of the three cannot: 60% of 4 pods is
    2.4 pods of work, and three keys over one pod each would be over 3. So the heaviest
    exceeds one pod alone and the other two load theirs partly, as a Zipf-like skew would:
    the heavy users' shares of the heavy requests are 64/22/14%, and their requests are
    longer (agents writing code: 300-word questions, 600-token answers) than everyone
    else's (200-word chats, 80-token answers). Every user's requests start with 256 words
    of its own (its system prompt and context), which a pod that served the user before
    has in its prefix cache: the reason to send a user to the same pod at all.

    The arithmetic (`nominal_capacity` of the H100 profile; time per request is additive):
    a heavy request costs 0.66 pod-seconds with its prefix computed, 0.59 with it cached; a
    light user's chat 0.15, a chat from nobody 0.10. The mix is 40% heavy, 40% light
    users' (2/3 of the rest) and 20% nobody's, and the rate is 60% of the capacity without
    prefix hits (as in c): 7.0 requests/s of 11.7, 2.4 pods of work. The heavy users bring
    1.85 pods (1.65 if every prefix hits): the heaviest 1.19 (1.05), over one pod either
    way, the others 0.41 (0.36) and 0.26 (0.23). Light users and nobody bring 0.55 pods.
    So a pod that keeps the heaviest user queues without end, whatever else it is sent.

    48 light users: their prefixes and the heavy users' take 13k tokens, a sixth of one
    pod's KV cache, so every pod can hold all of them (no policy loses hits to eviction):
    what a key that moves loses is its prefix, once per pod it lands on.
    """
    pods = _pods(h100=4)
    heavy = RequestClass(
        name="agent",
        weight=0.4,
        prompt_words=ln(300, 0.4, 64, 1200),
        output_tokens=ln(600, 0.4, 64, 1600),
    )
    chat = RequestClass(
        name="chat",
        weight=0.6,
        prompt_words=ln(200, 0.4, 16, 800),
        output_tokens=ln(80, 0.4, 8, 300),
    )
    # The capacity without prefix hits: heavy requests and light users' chats carry their
    # user's prefix (2/3 of the chats), nobody's chats none.
    prefix = HOT_KEYS_PREFIX_WORDS
    costed = (
        heavy.model_copy(update={"prompt_words": ln(300 + prefix, 0.1)}),
        chat.model_copy(
            update={
                "name": "light",
                "weight": 0.6 * HOT_KEYS_LIGHT_FRACTION,
                "prompt_words": ln(200 + prefix, 0.1),
            }
        ),
        chat.model_copy(update={"weight": 0.6 * (1 - HOT_KEYS_LIGHT_FRACTION)}),
    )
    capacity = fleet_capacity(pods, costed)
    trace = TraceSpec(
        duration_s=duration_s,
        rate_per_s=0.6 * capacity,
        request_classes=(heavy, chat),
        users=Users(
            heavy=heavy_shares,
            heavy_classes=(heavy.name,),
            light=HOT_KEYS_LIGHT,
            light_fraction=HOT_KEYS_LIGHT_FRACTION,
            prefix_words=max(1, round(prefix * request_scale)),
        ),
        model=MODEL,
    )
    return pods, trace, capacity


def build_scenario(name: str, *, duration_s: float, request_scale: float = 1.0) -> Scenario:
    """Scenario `name` (a to h, g2, c96, f2, or `<scenario>@<variant>`: `VARIANTS`) lasting
    `duration_s` seconds of arrivals (a, b, c, e, f, f2: three times; h: four).

    `request_scale` multiplies every prompt and output length (a smoke run uses short
    requests so that it drains in seconds); rates follow the resulting capacity. A
    ValueError names an unknown scenario or variant, or a variant that does not apply.
    """
    base, _, variant = name.partition("@")
    if not variant:
        return _build(name, duration_s=duration_s, request_scale=request_scale)
    [run_name] = scenario_names([base], variant)
    changes = VARIANTS[variant].changes[base]
    scenario = _build(base, duration_s=duration_s, request_scale=request_scale, changes=changes)
    return dataclasses.replace(
        scenario, name=run_name, title=f"{scenario.title}; variant {variant}: {changes.title}"
    )


def _build(
    name: str, *, duration_s: float, request_scale: float, changes: Changes = _UNCHANGED
) -> Scenario:
    """`build_scenario` for a scenario's own name, with a variant's `changes`."""

    def ln(mean: float, sigma: float, low: int = 1, high: int = 1_000_000) -> LogNormal:
        k = request_scale
        return LogNormal(
            mean=mean * k, sigma=sigma, min=max(1, round(low * k)), max=max(2, round(high * k))
        )

    if name == "f2":
        f = _build("f", duration_s=duration_s, request_scale=request_scale)
        return dataclasses.replace(
            f,
            name=name,
            title=f"{f.title}; two server replicas, one Envoy each, requests split 70/30",
            policies=("project",),
            replicas=Replicas(names=("a", "b"), split=(0.7, 0.3)),
        )
    adapters: tuple[str, ...] = ()
    session_affinity = False
    flow_control: Mapping[str, Any] | None = None
    policies: tuple[str, ...] | None = None
    windows: Windows | None = None
    project_balancing: Mapping[str, Any] | None = None
    warmup_s = 0.0
    faults: Faults | None = None
    gray: GrayFaults | None = None
    chat = RequestClass(
        name="chat", prompt_words=ln(500, 0.4, 32, 2000), output_tokens=ln(150, 0.4, 8, 600)
    )
    if name == "a":
        # Three times as long (48 s by default): in 16 s, about 110 requests, the P99 was the
        # second slowest request, and the same seed gave 0.33 to 0.43 s in three runs.
        duration_s *= 3
        pods = _fleet(changes, h100=2, a10g=2)
        classes: tuple[RequestClass, ...] = (chat,)
        capacity = fleet_capacity(pods, classes)
        trace = TraceSpec(
            duration_s=duration_s, rate_per_s=0.65 * capacity, request_classes=classes, model=MODEL
        )
        title = "mixed generations (2 H100-like + 2 A10G-like pods, Poisson at 65% of capacity)"
    elif name == "b":
        # DESIGN.md's shape: bursts that overload single pods while the fleet has headroom,
        # and skewed request sizes. Short chat, plus rare documents (10k-24k tokens, 0.8% of
        # requests) whose prefill holds a pod's whole token budget for 2-4 s: a chat that
        # lands behind one waits for it (head-of-line blocking, as in vLLM's chunked
        # prefill), whatever the fleet's load. The documents are under 1% of requests, so
        # P99 measures the chats they block, not their own prefill. Base load 50% of
        # capacity, gamma arrivals, three 1.8x bursts. Three times as long as a run (48 s by
        # default): a 16 s run has one or two documents. Two earlier shapes (3.5x bursts to
        # 140% of the fleet; 15% of requests 1.5k-6k-token documents) gave even the oracle
        # only 19-28% on P99: every pod overloaded at once, or a tail made of the documents'
        # own prefill. Every policy replays the same trace.
        duration_s *= 3
        pods = _fleet(changes, h100=4)
        classes = (
            RequestClass(
                name="chat",
                weight=0.992,
                prompt_words=ln(300, 0.4, 16, 1200),
                output_tokens=ln(120, 0.4, 8, 400),
            ),
            RequestClass(
                name="document",
                weight=0.008,
                prompt_words=ln(16000, 0.25, 10000, 24000),
                output_tokens=ln(40, 0.4, 8, 200),
            ),
        )
        capacity = fleet_capacity(pods, classes)
        bursts = _bursts(changes, duration_s, (0.2, 0.1, 1.8), (0.5, 0.1, 1.8), (0.75, 0.1, 1.8))
        trace = TraceSpec(
            duration_s=duration_s,
            rate_per_s=0.5 * capacity,
            arrivals="gamma",
            burstiness_cv=2.5,
            bursts=bursts,
            request_classes=classes,
            model=MODEL,
        )
        title = (
            "bursty (4 identical pods, gamma arrivals cv 2.5 at 50% of capacity, 1.8x bursts;"
            " short chat and 0.8% 10k-24k-token documents)"
        )
    elif name in ("c", "c96"):
        # Every group's first request on a pod misses; in one run's length that is about a
        # quarter of all requests. So c runs three times as long and its figures start after
        # the first third: a prefix cache serves a fleet for hours, not for 16 seconds.
        # c96 is c with 96 groups instead of 32: their prefixes are 2.5x one pod's KV cache,
        # so no pod can keep them all (in c every pod ends up holding all 32), while a
        # quarter of them fits in each. That is where the hit rate can differ by policy.
        groups = changes.prefix_groups or (32 if name == "c" else 96)
        prefix_words = changes.prefix_words or 2048
        warmup_s = duration_s
        duration_s *= 3
        pods = _pods(h100=4)
        classes = (
            RequestClass(
                name="question",
                prompt_words=ln(256, 0.2, 64, 600),
                output_tokens=ln(64, 0.3, 8, 200),
            ),
        )
        # Capacity without cache hits for the full prompt (prefix + question).
        full = (
            RequestClass(
                name="full",
                prompt_words=ln(prefix_words + 256, 0.1),
                output_tokens=classes[0].output_tokens,
            ),
        )
        capacity = fleet_capacity(pods, full)
        trace = TraceSpec(
            duration_s=duration_s,
            rate_per_s=0.8 * capacity,
            request_classes=classes,
            prefix_groups=PrefixGroups(groups=groups, prefix_words=prefix_words, fraction=1.0),
            model=MODEL,
        )
        title = (
            f"shared prefixes ({groups} groups of a {prefix_words:,}-token system prompt,"
            " 256-token questions)"
        )
        session_affinity = True
    elif name == "d":
        pods = _fleet(changes, h100=4)
        classes = (chat,)
        capacity = fleet_capacity(pods, classes)
        trace = TraceSpec(
            duration_s=duration_s,
            rate_per_s=0.6 * capacity,
            bursts=_bursts(changes, duration_s),
            request_classes=classes,
            model=MODEL,
        )
        title = "uniform fleet, steady Poisson traffic at 60% of capacity"
    elif name == "e":
        # As in c: three times as long, figures after the first third, once every adapter
        # has been loaded somewhere (adapter loads then count thrash, not first loads).
        warmup_s = duration_s
        duration_s *= 3
        adapters = (
            ADAPTERS
            if changes.adapters is None
            else tuple(f"adapter-{i}" for i in range(changes.adapters))
        )
        pods = tuple(
            PodSpec(
                name=f"h100-{i}", profile=dataclasses.replace(H100, max_loras=2), adapters=adapters
            )
            for i in range(4)
        )
        classes = (chat,)
        capacity = fleet_capacity(pods, classes)
        trace = TraceSpec(
            duration_s=duration_s,
            rate_per_s=0.6 * capacity,
            request_classes=classes,
            lora=Lora(
                adapters=adapters,
                zipf_s=1.2 if changes.zipf_s is None else changes.zipf_s,
                fraction=0.9,
            ),
            model=MODEL,
        )
        title = "LoRA (4 pods, 8 adapters, 2 slots per pod, Zipf-skewed popularity)"
    elif name == "f":
        # Overload: half the fleet's capacity, then a ramp to twice it, with 20% Critical,
        # 50% Standard and 30% Sheddable requests. Three times the run's duration: the
        # windows need enough Critical requests for a P99 (about 40 and 200 of them).
        duration_s *= 3
        pods = _pods(h100=4)
        classes = (chat,)
        capacity = fleet_capacity(pods, classes)
        trace = TraceSpec(
            duration_s=duration_s,
            rate_per_s=0.5 * capacity,
            phases=(
                Phase(start_s=0.3 * duration_s, rate_per_s=0.5 * capacity),
                Phase(start_s=0.45 * duration_s, rate_per_s=2.0 * capacity),
            ),
            ramp=True,
            request_classes=classes,
            bands=BandMix(critical=0.2, standard=0.5, sheddable=0.3),
            model=MODEL,
        )
        title = (
            "overload (4 identical pods, 50% of capacity, then a ramp to 200%; "
            "20% Critical, 50% Standard, 30% Sheddable)"
        )
        flow_control = {
            "enabled": True,
            # The simulated H100's max_num_seqs: what a pod runs at once without queueing.
            "default_pod_concurrency": H100.max_num_seqs,
        }
        # A pool kept near its capacity wants Envoy's in-flight counting, strongly: least
        # request with bias 3 sends each request to the least busy pod almost always, where
        # round robin would queue some pods (and bias 1 still lets prefill collisions make
        # Critical's tail: over 3 seeds its overload P99 was 0.48-0.80 s, 0.43-0.53 s here).
        project_balancing = {"active_request_bias": 3.0}
        policies = ("round_robin", "least_request", "project")
        windows = Windows(
            half_load=(0.03 * duration_s, 0.3 * duration_s),
            overload=(0.45 * duration_s, duration_s),
        )
    elif name == "h":
        # Four times as long: 48 light users need a few requests each for their stickiness.
        duration_s *= 4
        pods, trace, capacity = _hot_keys(
            duration_s,
            ln=ln,
            request_scale=request_scale,
            heavy_shares=changes.heavy or HOT_KEYS_HEAVY,
        )
        title = (
            "hot keys (4 identical pods at 60% of capacity; 40% of requests from 3 heavy users,"
            " the heaviest over one pod alone; the rest from 48 light users or nobody)"
        )
        session_affinity = True
    elif name == "g":
        # d's fleet and load, with faults at fixed points: a pod killed at 20% of the run, a
        # second pod's prefilling requests reset at 35%, the first back at 55%, the control
        # plane killed and restarted at 75% (every pod up, so its inputs are unchanged). The
        # oracle is a router inside the simulator, with no Envoy and no control plane to
        # fail, so g compares Envoy's two balancers with the project.
        pods = _pods(h100=4)
        classes = (chat,)
        capacity = fleet_capacity(pods, classes)
        trace = TraceSpec(
            duration_s=duration_s, rate_per_s=0.6 * capacity, request_classes=classes, model=MODEL
        )
        title = (
            "faults (4 identical pods, Poisson at 60% of capacity; a pod killed at 20%, another"
            " reset mid-prefill at 35%, the first back at 55%, the control plane killed and"
            " restarted at 75%)"
        )
        policies = ("round_robin", "least_request", "project")
        faults = Faults(
            kill_pod="h100-0",
            kill_s=0.2 * duration_s,
            reset_pod="h100-1",
            reset_s=0.35 * duration_s,
            revive_s=0.55 * duration_s,
            control_plane_s=0.75 * duration_s,
        )
    elif name == "g2":
        # d's fleet and load, with gray failures in turn (bench/gray.py), once the pool
        # is in its steady state: a pod wedged after its streams' first chunk from 20% of
        # the run and restarted at 40%, another resetting every request from 45% to 60%,
        # a third claiming 4x its KV cache from 65% on.
        pods = _pods(h100=4)
        classes = (chat,)
        capacity = fleet_capacity(pods, classes)
        trace = TraceSpec(
            duration_s=duration_s, rate_per_s=0.6 * capacity, request_classes=classes, model=MODEL
        )
        title = (
            "gray failures (4 identical pods, Poisson at 60% of capacity; a pod wedged after"
            " its first chunk at 20% and restarted at 40%, another resetting every request at"
            " 45-60%, a third claiming 4x its KV cache from 65%)"
        )
        policies = ("round_robin", "least_request", "project")
        gray = GrayFaults(
            wedge_pod="h100-0",
            wedge_s=0.2 * duration_s,
            unwedge_s=0.4 * duration_s,
            reset_pod="h100-1",
            reset_s=0.45 * duration_s,
            reset_end_s=0.6 * duration_s,
            liar="h100-2",
            liar_s=0.65 * duration_s,
            liar_end_s=0.98 * duration_s,
        )
    else:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    return Scenario(
        name=name,
        title=title,
        pods=pods,
        trace=trace,
        drain_s=max(6.0, 1.25 * duration_s),
        capacity_requests_per_s=capacity,
        adapters=adapters,
        session_affinity=session_affinity,
        flow_control=flow_control,
        policies=policies,
        windows=windows,
        project_balancing=project_balancing,
        warmup_s=warmup_s,
        faults=faults,
        gray=gray,
    )


SCENARIOS = ("a", "b", "c", "d", "e", "f", "g", "g2", "h", "c96", "f2")
