"""Every number the policy uses, as data: `Tuning`.

The routing rules (xds_server/policy) take their thresholds from a `Tuning` handed to them
with the decision's inputs, never from literals, so that each number has a name, a meaning,
a unit, a default and the benchmark run behind it, and so that an operator can override it
per pool (`pools[].advanced` over `balancing.advanced` in the routing config) without a
release. The defaults were tuned on the benchmark's scenarios (docs/benchmark.md); the
`evidence` of each field names the run. `docs/tuning.md` is generated from this module
(`python -m xds_server.tuning`), and a test keeps it in step.

The few numbers below `Tuning` are not tuning: limits of Envoy's API or of the policy's
arithmetic, fixed whatever the traffic.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AdvancedOverrides",
    "MAX_WEIGHT",
    "MIN_RELATIVE_CAPACITY",
    "RETRY_AFTER_LADDER_S",
    "Tuning",
    "UNLIMITED",
    "reference_markdown",
]

# The best pod's EDS weight. Large, so that a slow pod's tiny weight keeps its resolution;
# at most 100,000 so that 10,000 endpoints' weights stay within Envoy's uint32 sum.
MAX_WEIGHT = 100_000
# max_requests for a band that is not limited (Envoy's own default is 1,024).
UNLIMITED = 1_000_000
# Retry-After values in seconds: a changed value is an RDS push, so it moves in coarse steps.
RETRY_AFTER_LADDER_S = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60, 90, 120, 180)
# A relative capacity is divided by, never below this (a pod of no capacity is still ranked).
MIN_RELATIVE_CAPACITY = 1e-3


def _knob(
    default: float,
    *,
    meaning: str,
    unit: str,
    evidence: str,
    ge: float = 0.0,
    le: float | None = None,
    gt: float | None = None,
) -> Any:
    return Field(
        default,
        ge=None if gt is not None else ge,
        gt=gt,
        le=le,
        description=meaning,
        json_schema_extra={"unit": unit, "evidence": evidence},
    )


class Tuning(BaseModel):
    """The policy's thresholds and factors, by rule (docs/tuning.md lists them all)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Weights (scoring.py, factors.py).
    weight_ladder: float = _knob(
        1.15,
        gt=1.0,
        le=4.0,
        unit="ratio",
        meaning="Weights are quantized to MAX_WEIGHT / ratio^k, so that near-equal pods get"
        " equal weights and small noise does not become an EDS push.",
        evidence="scenario d (uniform fleet): equal pods balance by plain round robin",
    )
    kv_knee: float = _knob(
        0.8,
        le=1.0,
        unit="share of the KV cache",
        meaning="KV-cache use above which the KV scorer starts to cut a pod's weight.",
        evidence="design: a pod about to preempt should get less",
    )
    kv_floor: float = _knob(
        0.05,
        gt=0.0,
        le=1.0,
        unit="factor",
        meaning="The KV scorer's factor at a full cache.",
        evidence="design",
    )
    reference_slots: float = _knob(
        32.0,
        gt=0.0,
        le=100_000,
        unit="requests",
        meaning="The batch a pod of the pool's largest capacity is assumed to run, for the"
        " running scorer (off by default).",
        evidence="bench/results/h-running-scorer",
    )
    prefix_cache_base: float = _knob(
        0.5,
        gt=0.0,
        le=10.0,
        unit="factor",
        meaning="The prefix-cache scorer's factor at a hit rate of 0 (it is base + hit rate;"
        " the scorer is off by default).",
        evidence="design",
    )
    # Capacity (capacity.py).
    capacity_vouch_ratio: float = _knob(
        2.0,
        ge=1.0,
        le=1_000.0,
        unit="factor",
        meaning="A slow pod's KV claim is cut to the median of the peers' claims within this"
        " factor of it (its like, which vouch for it), or of all peers when none is: a busy"
        " H100 beside A10Gs is not taken for an A10G.",
        evidence="bench/results/capacity-vouch (a, seeds 1-3)",
    )
    min_capacity_peers: int = _knob(
        2,
        ge=1,
        le=1000,
        unit="pods",
        meaning="The fewest other pods of a hardware class whose median a KV capacity is"
        " compared with: with one, a pod that claimed a tiny cache could get its only peer"
        " refused; with two, one liar moves the median by at most half.",
        evidence="tests/policy/test_scoring_distrust.py",
    )
    # Spilling session keys (spill.py).
    spill_full: float = _knob(
        0.8,
        le=1.0,
        unit="share of batch_limit",
        meaning="A pod whose batch reaches this share of the pool's batch_limit, the other"
        " pods queueing nothing, spills its keys.",
        evidence="bench/results/h (scenario h, 3 seeds)",
    )
    spill_release: float = _knob(
        0.6,
        le=1.0,
        unit="share of batch_limit",
        meaning="A spilling pod keeps spilling while its batch is at this share or more"
        " (released at its first short queue, a full pod took its keys back and queued"
        " again at once); below it a queue is a prefill backlog.",
        evidence="bench/results/h-first-spill",
    )
    spill_ahead_full: float = _knob(
        0.65,
        le=1.0,
        unit="share of batch_limit",
        meaning="A pod clearly ahead of the others (spill_ahead) spills from this share of"
        " the limit: a hot key's pod, not a busy pool.",
        evidence="bench/results/h-ahead",
    )
    spill_ahead: float = _knob(
        1.5,
        ge=1.0,
        le=100.0,
        unit="x other pods' median batch",
        meaning="How far ahead of the other pods' median batch a pod is 'clearly ahead'.",
        evidence="bench/results/h-ahead",
    )
    spill_queue_ratio: float = _knob(
        2.0,
        ge=1.0,
        le=100.0,
        unit="x other pods' median queue",
        meaning="A pod spills when it queues beyond queue_slack plus this many times the"
        " other pods' median queue.",
        evidence="bench/results/c-3-seeds, bench/results/h",
    )
    spill_max_hit_rate: float = _knob(
        0.5,
        le=1.0,
        unit="share of prompt tokens",
        meaning="A pod whose prefix cache serves this share of its prompt tokens or more"
        " keeps its keys through a full batch (its prefixes are worth more than a wait).",
        evidence="bench/results/c-3-seeds",
    )
    max_miss_cost_hit_rate: float = _knob(
        0.95,
        le=0.999,
        unit="share of prompt tokens",
        meaning="The most hit rate counted in a backlog's miss cost (19 requests), so that a"
        " cached pod's keys still move when its queue runs away.",
        evidence="bench/results/c-3-seeds",
    )
    max_spilling_share: float = _knob(
        0.5,
        le=1.0,
        unit="share of healthy pods",
        meaning="At most this share of a pool's healthy pods spill, the most loaded first:"
        " with three of four out, one pod took every key.",
        evidence="bench/results/h-spill-to-pool",
    )
    # Key homes (homes.py).
    home_window_intervals: float = _knob(
        40.0,
        ge=1.0,
        le=10_000.0,
        unit="decisions",
        meaning="A pool's key homes are weighed over this many busy decisions and moved at"
        " most once per window. Decisions follow every changed scrape and load report: on"
        " scenario c's four busy pods 40 took 2.5-2.8 s, not the 10 s of 40 scrape"
        " intervals.",
        evidence="bench/results/homes (c, seeds 4-8)",
    )
    home_tolerance: float = _knob(
        0.2,
        gt=0.0,
        le=10.0,
        unit="ratio - 1",
        meaning="Key homes move when some pod's share of the pool's load is off its share of"
        " the capacity by more than this (0.2: beyond 1.2x or under 0.8x); logged keys, by"
        " more than this plus one mean key, so that no single new key moves others.",
        evidence="bench/results/homes (c, seeds 4-8)",
    )
    home_max_factor: float = _knob(
        4.0,
        ge=1.0,
        le=100.0,
        unit="factor",
        meaning="A pod's ring weight is cut to no less than its capacity's over this; 1"
        " keeps the hash's homes.",
        evidence="bench/results/homes (c, seeds 4-8)",
    )
    home_spill_share: float = _knob(
        0.25,
        gt=0.0,
        le=1.0,
        unit="share of the window",
        meaning="Only a pod that spilled its keys in this share of the window's decisions"
        " has keys moved off it for good (a move costs each moved key its prefix).",
        evidence="bench/results/homes (c: moves by load share alone cost P95 0.14 -> 0.51 s)",
    )
    home_placed_max_pods: float = _knob(
        8.0,
        ge=2.0,
        le=64.0,
        unit="pods",
        meaning="Pools of at most this many pods have their logged session keys placed by"
        " their hashes (a few ladder steps a window, each building the session table);"
        " larger pools keep the spill rule.",
        evidence="bench/results/homes-placed: a window's search held the loop at most 30 ms"
        " for 4 pods, 53 ms for 8 (8 keys a pod)",
    )
    home_placement_steps: float = _knob(
        8.0,
        ge=1.0,
        le=32.0,
        unit="ladder steps",
        meaning="At most this many weight-ladder steps a window when placing logged keys.",
        evidence="tests/policy/test_homes.py (c's 32 keys placed in one or two steps)",
    )
    home_placement_target: float = _knob(
        0.1,
        gt=0.0,
        le=10.0,
        unit="ratio - 1",
        meaning="A placement of logged keys, once begun (beyond home_tolerance), goes on until"
        " every pod's share of the keys is within this of its capacity share, so that the"
        " next key does not push it past the tolerance again.",
        evidence="bench/results/homes-placed (c seeds 4-8: placing only to the tolerance left"
        " 13 prefix misses after the warm-up against the router's 7)",
    )
    home_free_step_gain: float = _knob(
        0.1,
        gt=0.0,
        le=1.0,
        unit="share of the spread",
        meaning="Within the tolerance, a step of the ring weights that moves no logged key is"
        " taken when it lowers the spread of the pods' load (keys seen and to come) by this"
        " share: it evens the slots where new keys land, at no prefix's cost, and a smaller"
        " gain is not worth a push.",
        evidence="bench/results/homes-few-moves/model.py (0.1 and 0.25 alike; 0 pushes for"
        " nothing)",
    )
    home_seen_once_count: float = _knob(
        1.5,
        gt=0.0,
        le=100.0,
        unit="requests (decayed)",
        meaning="A logged key whose decayed request count is under this counts as seen once:"
        " the share of requests that brought such keys is the share taken to bring keys"
        " not seen yet (Good-Turing), which land by the session table's slots.",
        evidence="design: halfway between one request and two",
    )
    home_key_prior: float = _knob(
        3.0,
        le=1_000.0,
        unit="times the mean key's requests",
        meaning="Each logged key weighs its recent requests plus this many times the mean"
        " key's: the noise of a key's requests moves no key, and a key twenty times as busy"
        " as the others weighs about six of them.",
        evidence="design: a key's decayed count (about 17 requests at c's rate) is off by a"
        " quarter by chance",
    )
    key_offer_points: int = _knob(
        1024,
        ge=1,
        le=65_536,
        unit="points on the ring of the spares",
        meaning="The buckets no pod holds are offered to the spares by a ring of the spares,"
        " each with this many points over the pods in rotation (at least one): a new key's"
        " requests all reach one pod before its bucket is pinned, and a spare that comes or"
        " goes moves only its own arcs.",
        evidence="200 pools of four pods, 256 buckets: the pod furthest from an even share of"
        " the offers is 16% off at the median, 23% at the 90th percentile, about what 256"
        " buckets' own hashes give (11% a pod)",
    )
    key_offer_width: int = _knob(
        1024,
        ge=1,
        le=1024,
        unit="spares",
        meaning="With key buckets, each bucket no pod holds is offered to this many spares"
        " (the next on the ring; all of them when there are fewer), and a new key's requests"
        " go to the one of them with the fewest in flight until its first is logged: with"
        " every spare, new keys that arrive together spread as a router's would, at the cost"
        " of a new key's second request landing elsewhere now and then; with one, a burst of"
        " one new key stays on one pod, but new keys that arrive together queue on one spare"
        " as often as they share it.",
        evidence='bench/results/bucket-homes/NOTES.md, "New keys by fewest in flight"',
    )
    key_spare_slack: float = _knob(
        100.0,
        le=1_000.0,
        unit="mean keys",
        meaning="With key buckets, a pod takes new keys while its pinned keys weigh at most"
        " its capacity share plus this many mean keys: at 0, only the pods at or under their"
        " share take new keys, often one at a time, which then takes every new key that"
        " arrives together; at 100, every pod short of a hundred mean keys over its share (on"
        " the benchmark, every pod that does not spill), and the requests in flight choose.",
        evidence='bench/results/bucket-homes/NOTES.md, "New keys by fewest in flight"',
    )
    home_step_span: float = _knob(
        3.0,
        ge=1.0,
        le=8.0,
        unit="ladder steps",
        meaning="Each step of a key placement tries the most loaded pod's ring weight down and"
        " the least loaded's up by 0 to this many ladder steps each (one step of four pods'"
        " weights moves about 3% of the slots: often no key of 32).",
        evidence="tests/policy/test_homes.py",
    )
    home_min_load: float = _knob(
        1.0,
        unit="requests per pod",
        meaning="Key homes move only while the pool's pods hold this many requests each on"
        " average (running plus waiting): an idle pool's shares are noise.",
        evidence="design",
    )
    # Whether affinity pays (affinity.py).
    affinity_min_cached_tokens: float = _knob(
        512.0,
        le=1_000_000.0,
        unit="prompt tokens per request",
        meaning="A pool's session keys stop sticking to their pods while the pods' prefix"
        " caches save fewer prompt tokens than this per request that returned to its key's"
        " pod (a short prefix is cached on every pod anyway; a key's first request misses"
        " wherever it goes).",
        evidence="bench/results/affinity-pays (h: about 130 per request, c: about 2,000);"
        " bench/results/bucket-homes (per return: c@more-prefixes' fresh fleets stay"
        " sticky)",
    )
    affinity_resume_factor: float = _knob(
        1.5,
        ge=1.0,
        le=100.0,
        unit="factor",
        meaning="Suspended keys stick again once the caches save this many times"
        " affinity_min_cached_tokens per request (hysteresis).",
        evidence="design",
    )
    affinity_streak_intervals: float = _knob(
        40.0,
        ge=1.0,
        le=100_000.0,
        unit="decisions",
        meaning="Affinity is suspended or resumed after this many busy decisions in a row"
        " argue for it (decisions follow every changed scrape and load report: 40 took"
        " 2.5-2.8 s on scenario c's four busy pods).",
        evidence="bench/results/affinity-pays (h: P99 0.184/0.172 s at 40 against"
        " 0.188/0.188 s at 80; c unchanged)",
    )
    # Health (health.py).
    max_stalled_share: float = _knob(
        0.5,
        le=1.0,
        unit="share of the pool's pods",
        meaning="Engine counters that show more than this share of a pool stalled are not"
        " believed (a pool does not wedge all at once; an exporter can).",
        evidence="design, as verdicts.py judges at most half a pool",
    )
    probation_weight: float = _knob(
        0.25,
        gt=0.0,
        le=1.0,
        unit="x the median weight of the pool's pods in rotation",
        meaning="The weight of a pod on probation: (re)started, its metrics page late, its"
        " health check answering. Small, so that a cold pod warms up on real requests and"
        " one that hangs them holds few until the Envoys' reports judge it.",
        evidence="tests/e2e/test_probation.py: a restarted pod whose /metrics hangs serves"
        " again within seconds; wedged, it is judged stalled as on full weight",
    )
    probation_max_s: float = _knob(
        120.0,
        gt=0.0,
        le=3600.0,
        unit="seconds",
        meaning="The longest a pod stays on probation without a page (from its first health"
        " answer): a page that never comes is an exporter to fix, not a pod to weigh"
        " blind for ever.",
        evidence="issue 36: a real vLLM restarted under load gave its first page after"
        " ~40 s; three times that",
    )
    # LoRA adapters (adapters.py, adapter_demand.py).
    adapter_activity_smoothing: float = _knob(
        0.05,
        gt=0.0,
        le=1.0,
        unit="share per decision",
        meaning="An adapter's activity moves this share of the way to 1 (some pod runs it)"
        " or 0 at each decision: it remembers about the last 20.",
        evidence="bench/results/e-stability",
    )
    idle_replica_share: float = _knob(
        0.25,
        le=10.0,
        unit="x the pods' mean load",
        meaning="A replica is idle when its adapter's demand per advertising pod is below"
        " this share of the pods' mean load (then dropped).",
        evidence="bench/results/e-stability",
    )
    max_adapter_activity: float = _knob(
        0.95,
        gt=0.0,
        le=0.999,
        unit="share of decisions",
        meaning="Activity above this tells little more, and the rate estimate from it would"
        " diverge at 1.",
        evidence="design",
    )
    adapter_rate_floor: float = _knob(
        0.01,
        gt=0.0,
        le=1.0,
        unit="requests",
        meaning="The rate of an adapter never seen running: adapters without history share"
        " a pod's load evenly.",
        evidence="design",
    )
    adapter_home_min_score: float = _knob(
        0.5,
        le=1.0,
        unit="share of the best pod's score",
        meaning="A pod may take a displaced adapter to wait for a slot while its smoothed"
        " score is at least this share of the best pod's.",
        evidence="bench/results/e-stability",
    )
    adapter_demand_step: float = _knob(
        1.25,
        gt=1.0,
        le=10.0,
        unit="ratio",
        meaning="A pod's adapters are compared on a geometric ladder of this ratio where"
        " near-equal ones must not decide.",
        evidence="bench/results/e-stability",
    )
    adapter_clearly_colder: float = _knob(
        2.0,
        gt=1.0,
        le=100.0,
        unit="ratio",
        meaning="Of the pods that could give a hot adapter a slot, one whose coldest"
        " adapter's demand is under the others' by this ratio gives it up.",
        evidence="bench/results/e-stability",
    )
    # LoRA adapters: placement by load where adapters outnumber slots (adapters.py, rule 4).
    adapter_load_s: float = _knob(
        0.1,
        le=600.0,
        unit="s",
        meaning="The time an engine takes to load an adapter into a free slot, its batch"
        " stalled meanwhile: what moving an adapter to a pod with an idle slot costs. A pod"
        " whose slots are all in use loads it only once one of its adapters has drained"
        " (seconds: a request's lifetime), a cost the policy cannot know and does not pay.",
        evidence="testbed/llm_sim, H100 profile: a step that loads one adapter lasts 0.100 s"
        " longer (bench/results/adapter-share); the real vLLM's load time is measured in"
        " issue 36",
    )
    adapter_share_tolerance: float = _knob(
        0.25,
        gt=0.0,
        le=10.0,
        unit="ratio - 1",
        meaning="In a pool with more adapters than slots, a pod is fed beyond its share"
        " when its requests exceed its capacity's share of the pool's by more than this"
        " (0.25: beyond 1.25x); it then gives an adapter to a pod with an idle slot.",
        evidence="bench/results/adapter-share (e with 16 adapters, Zipf 0.6)",
    )
    # Admission (admission.py).
    admission_kv_full: float = _knob(
        0.95,
        le=1.0,
        unit="share of the KV cache",
        meaning="A pod whose KV cache is this full is about to preempt: admission counts it full.",
        evidence="bench/results/f",
    )
    plausible_margin: float = _knob(
        0.25,
        le=100.0,
        unit="share of the pods' requests",
        meaning="What the Envoys' reports may claim in flight beyond what the pods hold:"
        " this share of it (scrape lag)...",
        evidence="tests/policy/test_admission.py",
    )
    plausible_slack_per_pod: float = _knob(
        2.0,
        le=10_000,
        unit="requests per pod",
        meaning="... and this many per pod (requests in transit).",
        evidence="tests/policy/test_admission.py",
    )
    admission_horizon_intervals: float = _knob(
        2.0,
        gt=0.0,
        le=100.0,
        unit="scrape intervals",
        meaning="How long the admission's limits stand: about one interval, and another to"
        " reach Envoy.",
        evidence="bench/results/f",
    )

    @model_validator(mode="after")
    def _spill_thresholds_in_order(self) -> Tuning:
        if not self.spill_release <= self.spill_ahead_full <= self.spill_full:
            raise ValueError(
                "spill thresholds out of order: need spill_release <= spill_ahead_full <="
                f" spill_full, got {self.spill_release} / {self.spill_ahead_full} /"
                f" {self.spill_full}"
            )
        return self

    def with_overrides(self, overrides: dict[str, float]) -> Tuning:
        """This tuning with `overrides` (validated: an unknown name or a value out of range
        is a ValueError)."""
        if not overrides:
            return self
        return Tuning.model_validate({**self.model_dump(), **overrides})


def reference_markdown() -> str:
    """docs/tuning.md: every field of `Tuning`, its default, unit, meaning and evidence."""
    lines = [
        "# Tuning reference",
        "",
        "Every number the routing policy uses (`xds_server/tuning.py`). Override them for every",
        "pool under `balancing.advanced`, or for one pool under `pools[].advanced`, in the",
        "routing config; values are validated (unknown names and values out of range are",
        "refused). Generated by `python -m xds_server.tuning`; a test keeps it in step.",
        "",
        "| name | default | unit | meaning | evidence |",
        "|---|---|---|---|---|",
    ]
    for name, field in Tuning.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        lines.append(
            f"| `{name}` | {field.default:g} | {extra.get('unit', '')} | {field.description}"
            f" | {extra.get('evidence', '')} |"
        )
    return "\n".join(lines) + "\n"


# A pool's `advanced:` overrides: names of Tuning's fields with their values.
AdvancedOverrides = Annotated[dict[str, float], Field(max_length=len(Tuning.model_fields))]


if __name__ == "__main__":
    print(reference_markdown(), end="")
