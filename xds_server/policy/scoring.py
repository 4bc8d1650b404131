"""GPU-aware weights: from each pod's live metrics to its EDS weight and health.

The slow loop of the design. Envoy balances every request by these weights: by default
(`balancing.active_request_bias` 0) with weighted round robin, which on equal weights is
plain round robin and spaces new requests evenly (a first token waits for its own prefill,
not for the decodes in flight); with a bias above 0 with least request, by `weight /
(active requests + 1)^bias`. What Envoy cannot see is how fast each pod serves and whether
it is saturated. So a pod's weight is its relative serving capacity, discounted when its
metrics say it is saturated:

    score = capacity^c · (1 / (1 + waiting - slack))^q · kv_headroom^k
            · (1 / (1 + running/slots))^r · (0.5 + prefix_hit_rate)^p

with the exponents c, q, k, r, p from `balancing.scorers` (0 turns a scorer off):

- capacity: the pod's serving capacity relative to the pool's largest, from its hardware
  class (`balancing.hardware_capacity`) or else from its KV-cache size (vLLM's
  `cache_config_info`): KV blocks track GPU memory and, within a model, throughput. The
  default exponent is 4, not 1. Envoy's weighted least request is proportional, not
  argmax: a host's share is its weight / (active + 1) over the sum of them, so a pod 12x
  slower with a throughput-proportional weight still gets a steady trickle of requests,
  each of which waits far longer for its first token than in a fast pod's queue. The 4th
  power keeps slow pods as standby for when the fast ones queue deeply (the queue scorer
  then cuts the fast pods' weights), while pods within ~10% of each other still share
  almost evenly. MAX_WEIGHT is 100,000 so that such small weights keep their resolution.
- waiting: requests queued in the engine, beyond `balancing.queue_slack` (default 1: a
  request that arrived during an engine step waits for the next one even on an idle pod,
  and taking that for a queue made equal pods' weights flicker apart). Each one beyond
  means the pod is full; with the default exponent 2 the first quarters the weight.
- kv_headroom: 1 up to 80% KV-cache use, then falling linearly to 0.05 at full: a pod that
  is about to preempt should get less.
- running / slots: in-flight requests relative to the pod's share of the pool's (default
  exponent 0: Envoy's own in-flight count is fresher).
- prefix_hit_rate: pods whose cache is serving hits (default exponent 0).

Scores are smoothed (EWMA, `balancing.smoothing`), then multiplied by
`balancing.long_prompt_weight_factor` (default 0.01) once per long prompt prefilling on the
pod: the Envoys' upstream access log says where each long prompt went as it starts, and
when its first token came (their load reports stand in for Envoys that do not log),
whereas metrics show a prefill only once requests queue behind it. The factor is not
smoothed, and not remembered: it applies while the long prompt prefills and not a moment
longer. Such a pod also spills (`spilling`): DEGRADED in the pool's assignment, so Envoy
sends it nothing new while another pod is healthy (envoy/endpoints.py); the factor then
ranks the pods where every one prefills (none spills then) or in a LoRA subset of
degraded holders. Then scores are scaled so the best pod gets MAX_WEIGHT, and quantized to a
geometric ladder (steps of 15%) so that near-equal pods get exactly equal weights (Envoy
then balances a uniform fleet by plain round robin) and small noise does not turn into
EDS pushes or swings between Envoys. A pool with session affinity also gets ring weights,
the capacity factor alone on the same ladder: consistent hashing sizes each pod's share of
the keys by its weight, and keys that moved with load would lose their cached prefixes
(envoy/clusters.py). Load moves keys another way: a pod loaded beyond the others, or near
its pool's `batch_limit`, sends its keys to other pods for a while (`spilling`, _spilling;
envoy/endpoints.py), and is DEGRADED in the pool with its weight cut, as for a long prompt.

Health: a pod whose scrapes could not connect at all (refused, reset: `PodSignals.down`)
is UNHEALTHY at the next decision, and HEALTHY again once a scrape succeeds; a pod that has
failed to answer scrapes for longer than `stale_after_s` (`PodSignals.silent_s`, which
grows only while scrapes are tried, so a stalled server does not take its own silence for
the pods') is UNHEALTHY until they resume; a pod being shut down is DRAINING.

A pod with no believed page yet (never scraped, or only failures: absent from `signals`,
or `PodSignals.scraped` False) is UNHEALTHY, with the lowest weight: a pod's page is the
only thing that sizes its weight, so a pod that has not said anything believable, or
whose page was refused as implausible (metrics/engines.py, sources/pod_metrics.py), must
not get traffic on a placeholder weight. It joins at the decision after its first good
scrape: a reachable pod is scraped within one `scrape_interval_s` of becoming a target,
and the controller waits for every pod's first word before a restarted server's first
snapshot (`Controller._warming`).

When no pod of a pool that is not down has fresh metrics (all stale, or none scraped yet),
`all_stale` decides: fail_open keeps them HEALTHY on their last weights, equal for pods
never scraped (a metrics outage should not become a serving outage, nor should a new
pool wait), fail_closed marks them UNHEALTHY so Envoy answers 503 until the first good
scrape; a pod known to be down never comes back that way.

A pod's KV capacity is believed only within `max_capacity_ratio` of the median of the
pool's other fresh pods of its hardware class (when there are `MIN_CAPACITY_PEERS` or
more of them): beyond it, the pod is treated as stale. The scraper refuses such pages
(counted, logged, sources/pod_metrics.py); this is the same rule applied to what was
believed before the peers had spoken, so that a pod scraped first cannot win the pool
on a claim its peers later contradict.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from types import MappingProxyType

from xds_server.config import BalancingConfig, EndpointConfig, PoolConfig
from xds_server.policy.adapters import AdapterPod, place_adapters
from xds_server.policy.state import EndpointState, Health, PoolState

__all__ = [
    "KV_KNEE",
    "MAX_WEIGHT",
    "MIN_CAPACITY_PEERS",
    "PodSignals",
    "SPILL_AHEAD",
    "SPILL_AHEAD_FULL",
    "SPILL_FULL",
    "SPILL_MAX_HIT_RATE",
    "SPILL_RELEASE",
    "ScoredPool",
    "capacity_peer_group",
    "endpoint_id",
    "median_without",
    "score_pool",
]

MAX_WEIGHT = 100_000
KV_KNEE = 0.8
_KV_FLOOR = 0.05
_LADDER = 1.15
# A session pod spills its keys when its batch reaches this share of the pool's
# `batch_limit`, and takes them back once it is below the second (_spilling): room for a
# few keys' requests, not the first free slot.
SPILL_FULL = 0.8
SPILL_RELEASE = 0.6
# A pod clearly ahead of the others, its batch `SPILL_AHEAD` times their median running
# or more, spills from this share of the limit: a hot key's pod, not a busy pool.
SPILL_AHEAD_FULL = 0.65
SPILL_AHEAD = 1.5
# ... unless its prefix cache serves this share of its prompt tokens or more: then its keys'
# prefixes are worth more than a slot's wait.
SPILL_MAX_HIT_RATE = 0.5
# The hit rate counted in a backlog's miss cost (_spilling) at most: 19 requests, so that
# a cached pod's keys still move when its queue runs away.
MAX_MISS_COST_HIT_RATE = 0.95
# The batch a pod of the largest capacity is assumed to run, for the running scorer.
_REFERENCE_SLOTS = 32.0
# An adapter's activity moves this share of the way towards 1 (some pod runs it) or 0 at
# each decision: it remembers about the last 20 (a few seconds: the controller re-scores
# at least every scrape interval).
_ACTIVITY_SMOOTHING = 0.05
# The fewest other pods whose median a KV capacity is compared with. With one, a pod that
# claimed a tiny cache could get its only peer refused; with two, the median is the mean of
# both, and one liar can move it by at most half.
MIN_CAPACITY_PEERS = 2


@dataclass(frozen=True, kw_only=True)
class PodSignals:
    """What the policy needs from one pod's latest metrics (metrics/ produces them).

    `silent_s`: how long the pod has failed to answer scrapes since its last good metrics
    (0 when the last scrape succeeded; it grows only while scrapes are tried, so a stall of
    this server does not age every pod at once). `down`: the last scrape could not connect
    at all (refused, reset): the pod is gone, whatever `all_stale` says. `scraped`: False
    for a pod with a verdict but no believed page yet (only failed scrapes): its other
    fields are then placeholders, and it is not in rotation.
    """

    silent_s: float
    waiting: float
    running: float
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    # LoRA adapters of the pod's running and waiting requests; of those, the running ones
    # and the waiting ones (None: not told apart, all count as both); its adapter slots
    # (vLLM's max_lora; None: not reported yet, see _place_adapters).
    adapters: tuple[str, ...] = ()
    running_adapters: tuple[str, ...] | None = None
    waiting_adapters: tuple[str, ...] | None = None
    max_adapters: int | None = None
    # The adapters it ran most recently, newest first, up to its slots (vLLM's history of
    # `lora_requests_info`): where a restarted server's placement starts.
    recent_adapters: tuple[str, ...] = ()
    prefix_hit_rate: float | None = None
    down: bool = False
    scraped: bool = True
    # How long the engine has run requests without processing a token (its own counters).
    stalled_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ScoredPool:
    state: PoolState
    # Smoothed scores by endpoint id, to pass back as `memory` next time; the adapter
    # placement (adapters.py; empty without adapters), to pass back as `placement`, and
    # each adapter's activity, to pass back as `adapter_activity`.
    memory: Mapping[str, float]
    placement: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    adapter_activity: Mapping[str, float] = field(default_factory=dict)
    # The pods spilling their session keys for load, to pass back as `spilled` (_spilling).
    spilled: frozenset[str] = frozenset()


def endpoint_id(endpoint: EndpointConfig) -> str:
    return f"{endpoint.address}:{endpoint.port}"


def _quantize(weight: float) -> int:
    """The ladder step nearest `weight`: MAX_WEIGHT / 1.15^k for a whole k, at least 1."""
    steps_down = round(math.log(MAX_WEIGHT / min(MAX_WEIGHT, max(weight, 1.0))) / math.log(_LADDER))
    return max(1, round(MAX_WEIGHT / _LADDER**steps_down))


def capacity_peer_group(
    pool: PoolConfig, endpoint: EndpointConfig, settings: BalancingConfig
) -> str | None:
    """The pods whose KV capacities `endpoint`'s is compared with: the pool's of its
    hardware class, named "pool/class" ("pool/" for none); None when its capacity is the
    class's configured one (`hardware_capacity`), so that its KV capacity is not used."""
    if endpoint.hardware is not None and endpoint.hardware in settings.hardware_capacity:
        return None
    return f"{pool.name}/{endpoint.hardware or ''}"


def median_without(ordered: Sequence[float], value: float | None) -> float:
    """The median of `ordered` (sorted, not empty once `value` is left out) with one
    occurrence of `value` left out (None, or a value not in it: nothing left out).
    Constant time, so that a pod's peers' median costs nothing per scrape."""
    skip = len(ordered)
    if value is not None:
        index = bisect.bisect_left(ordered, value)
        if index < len(ordered) and ordered[index] == value:
            skip = index
    count = len(ordered) - (skip < len(ordered))

    def at(i: int) -> float:
        return ordered[i if i < skip else i + 1]

    middle = count // 2
    return at(middle) if count % 2 else (at(middle - 1) + at(middle)) / 2


def _unbelieved_capacities(
    pool: PoolConfig, fresh: Mapping[str, PodSignals], settings: BalancingConfig
) -> set[str]:
    """Fresh pods whose KV capacity is over `max_capacity_ratio` times the median of their
    group's other fresh pods (`capacity_peer_group`), when there are enough of them."""
    groups: dict[str, dict[str, float]] = {}
    for endpoint in pool.endpoints:
        key = endpoint_id(endpoint)
        s = fresh.get(key)
        group = capacity_peer_group(pool, endpoint, settings)
        if s is not None and s.kv_capacity_tokens and group is not None:
            groups.setdefault(group, {})[key] = float(s.kv_capacity_tokens)
    unbelieved: set[str] = set()
    for members in groups.values():
        if len(members) <= MIN_CAPACITY_PEERS:
            continue
        ordered = sorted(members.values())
        unbelieved.update(
            key
            for key, capacity in members.items()
            if capacity > settings.max_capacity_ratio * median_without(ordered, capacity)
        )
    return unbelieved


def _stuck(
    keys: Set[str], signals: Mapping[str, PodSignals], settings: BalancingConfig
) -> dict[str, str]:
    """The pods whose engine ran requests and processed no token for `stall_after_s` by
    its own counters: "stalled", out of rotation until its tokens move again. Engines
    count a prompt's tokens when its prefill ends, so a pod prefilling a long prompt
    alone moves none for seconds: `keys` leaves out those known to (long prompts). When
    more than half the pool looks so, the counters are not believed (a pool does not
    wedge all at once; an exporter can), as verdicts.py judges at most half a pool."""
    stuck = {
        key: "stalled"
        for key in keys
        if (s := signals.get(key)) is not None and s.stalled_s >= settings.stall_after_s
    }
    return stuck if len(stuck) <= len(keys) // 2 else {}


def _capacities(
    endpoints: tuple[EndpointConfig, ...],
    signals: Mapping[str, PodSignals],
    settings: BalancingConfig,
    slowness: Mapping[str, int] = MappingProxyType({}),
) -> dict[str, float]:
    """Relative capacity per endpoint (the largest is 1); unknown ones count as the largest.
    `signals` are those of pods scraped, and believed (stale ones too: the ring weights
    must not move when a pod's metrics stop).

    Capacity is measured, not only believed: a pod that claims a larger KV cache than the
    median of the pool's other claims, and whose requests take longer than its peers'
    (`slowness`, from the Envoys' reports: verdicts.py), counts as that median while it
    has any slowness. A larger pod that serves at its peers' pace keeps its claim; a liar
    gets its peers' share, which is what it has shown it serves."""
    raw: dict[str, float | None] = {}
    for endpoint in endpoints:
        key = endpoint_id(endpoint)
        if endpoint.hardware is not None and endpoint.hardware in settings.hardware_capacity:
            raw[key] = settings.hardware_capacity[endpoint.hardware]
        elif (s := signals.get(key)) is not None and s.kv_capacity_tokens:
            raw[key] = float(s.kv_capacity_tokens)
        else:
            raw[key] = None
    claimed_by = {k: v for k, v in raw.items() if v is not None}
    for key, steps in slowness.items():
        claimed = claimed_by.get(key)
        others = [v for k, v in claimed_by.items() if k != key]
        if claimed is not None and others and steps > 0:
            raw[key] = min(claimed, statistics.median(others))
    known = [v for v in raw.values() if v is not None]
    top = max(known, default=1.0)
    return {key: 1.0 if value is None else value / top for key, value in raw.items()}


def _score(signals: PodSignals, capacity: float, settings: BalancingConfig) -> float:
    weights = settings.scorers
    kv = signals.kv_usage
    kv_headroom = 1.0 if kv is None or kv <= KV_KNEE else max(_KV_FLOOR, (1 - kv) / (1 - KV_KNEE))
    slots = max(1.0, capacity * _REFERENCE_SLOTS)
    hit_rate = signals.prefix_hit_rate or 0.0
    factors = (
        (capacity, weights.capacity),
        (1 / (1 + max(0.0, signals.waiting - settings.queue_slack)), weights.queue),
        (kv_headroom, weights.kv_cache),
        (1 / (1 + max(0.0, signals.running) / slots), weights.running),
        (0.5 + min(1.0, max(0.0, hit_rate)), weights.prefix_cache),
    )
    return float(math.prod(value**exponent for value, exponent in factors if exponent))


def _spilling(
    pool: PoolConfig,
    healthy: list[str],
    fresh: Mapping[str, PodSignals],
    capacities: Mapping[str, float],
    spilled: Set[str],
    settings: BalancingConfig,
) -> frozenset[str]:
    """The pods of a session-affinity pool whose keys spill to other pods because they are
    loaded beyond the others (long prompts aside, see score_pool).

    A pod starts to spill when it queues beyond `queue_slack` plus twice the median queue
    of the pool's other pods, or, with the pool's `batch_limit` known and the other pods'
    median queue empty, when its batch reaches `SPILL_FULL` of that limit (a first token
    waits for every decode of the batch, and at the limit for a free slot), or already
    `SPILL_AHEAD_FULL` of it when it runs `SPILL_AHEAD` times the other pods' median batch
    or more. The earlier start is for a pod clearly ahead: on scenario h the heaviest key
    alone kept its pod at 30-40 running of 48 while the others ran 10-20, and its requests
    made the tail (P99 1.23x the oracle's); spilling every pod from 65% moved light keys of
    unloaded pods too (their stickiness 92%), the lead keeps them home (97% in two runs;
    100% for pods never spilled), and P99 is 1.13-1.17x the oracle's. Hot keys on
    one pod, not a surge that every pod queues through: measured on scenario c's cold
    start, spilling on any queue moved keys off the pods that held their prefixes while
    every pod's queue was draining, and its prefix-cache hits fell from 1.2x round robin's
    to 1.1x. The limit is configured, not guessed: vLLM exports no `max_num_seqs`, and it
    also queues when prefills use up a step's token budget, with free slots, so a limit
    learned from queues came out too low on c. A pod whose prefix cache serves
    `SPILL_MAX_HIT_RATE` of its prompt tokens or more keeps its keys through a full batch:
    c's 2,048-token prefixes moved off full pods cost more than the wait (prefix hits
    1.14-1.17x round robin's in the quick run, 1.2x and more without); and spilling on a
    batch twice the other pods' median cost c's P99 (0.17 s to 1.1 s).

    A queue beside a batch below `SPILL_RELEASE` of the limit is a prefill backlog (the
    engine queues when a step's token budget is used up, with free slots), which the next
    steps clear; it moves keys only once longer than what moving costs, the extra prefill
    of a request whose prefix is cached where it is (`_miss_cost`: none at a 0 hit rate, 7
    queued requests at 0.88). Measured on scenario c, whose pods' hit rates are 0.66-0.84
    once warm: a backlog of 2 beside 3-8 running requests of 48 spilled a pod's keys, and
    the first moved requests missed and waited 0.45-0.57 s for their first token (the P99
    is the 3rd slowest request: 0.23 and 0.42 s in two runs of seed 1, 0.17 without such a
    spill). On scenario h the heavy keys' pods spilled at hit rates 0.27-0.43, beside 16
    and 36 running, and over 3 seeds no spill was held back; a queue behind a fuller
    batch waits for decodes to finish, and spills as before.

    A pod that spills keeps spilling while its batch is at `SPILL_RELEASE` of the limit or
    more: released at its first short queue, a full pod took its keys back with no free
    slot and queued again at once (scenario h: 19 spills of 0.75 s in 64 s, P99 TTFT 2 s).

    At most half the healthy pods spill, the most loaded first: a spilled pod's keys go to
    the others, and with three of four out one pod took every key."""
    if not pool.session_affinity:
        return frozenset()
    limit = pool.batch_limit
    present = [key for key in healthy if key in fresh]
    queues = {key: fresh[key].waiting for key in present}
    ordered_queues = sorted(queues.values())
    ordered_running = sorted(fresh[key].running for key in present)

    def typical(ordered: list[float], value: float) -> float:
        return median_without(ordered, value) if len(ordered) > 1 else 0.0

    def loaded(key: str) -> bool:
        signals = fresh[key]
        hit_rate = signals.prefix_hit_rate or 0.0
        typical_queue = typical(ordered_queues, queues[key])
        backlog = limit is not None and signals.running < SPILL_RELEASE * limit
        worth = _miss_cost(hit_rate) if backlog else 0.0
        if signals.waiting > settings.queue_slack + 2 * typical_queue + worth:
            return True
        if limit is None or hit_rate >= SPILL_MAX_HIT_RATE:
            return False
        if typical_queue == 0 and signals.running >= SPILL_FULL * limit:
            return True
        if (
            typical_queue == 0
            and signals.running >= SPILL_AHEAD_FULL * limit
            and signals.running >= SPILL_AHEAD * typical(ordered_running, signals.running)
        ):
            return True
        return key in spilled and signals.running >= SPILL_RELEASE * limit

    candidates = sorted(
        (key for key in present if loaded(key)),
        key=lambda k: (-queues[k], -fresh[k].running / max(capacities.get(k, 1.0), 1e-3), k),
    )
    return frozenset(candidates[: len(healthy) // 2])


def _miss_cost(hit_rate: float) -> float:
    """The extra prefill of a request whose key moves, in prefills of a request that stays:
    a prompt whose cached share on its pod is `hit_rate` prefills 1 - hit_rate of its
    tokens there and all of them elsewhere (for want of per-request figures, the pod's
    rate stands in for every request's)."""
    cached = min(hit_rate, MAX_MISS_COST_HIT_RATE)
    return cached / (1.0 - cached)


def score_pool(
    pool: PoolConfig,
    *,
    settings: BalancingConfig,
    signals: Mapping[str, PodSignals],
    memory: Mapping[str, float],
    draining: Set[str] = frozenset(),
    placement: Mapping[str, tuple[str, ...]] = MappingProxyType({}),
    adapter_activity: Mapping[str, float] = MappingProxyType({}),
    long_prompts: Mapping[str, int] = MappingProxyType({}),
    spilled: Set[str] = frozenset(),
    verdicts: Mapping[str, str] = MappingProxyType({}),
    slowness: Mapping[str, int] = MappingProxyType({}),
) -> ScoredPool:
    """The pool's endpoint states from its pods' `signals` (by endpoint id).

    `memory`, `placement`, `adapter_activity` and `spilled` are the previous call's
    (empty at first); `draining` lists endpoints being shut down;
    `long_prompts` the long prompts in flight per endpoint id; `verdicts` the pods the
    Envoys' reports show stalled or failing (by endpoint id: the reason), which are out of
    rotation like a pod known to be down; `slowness` the pods slower per request than
    their peers (steps), whose claims beyond their peers' are not believed
    (`_capacities`). Pure: the same inputs give the same output.
    """
    keys = {endpoint_id(e) for e in pool.endpoints}
    verdicts = {**_stuck(keys - long_prompts.keys(), signals, settings), **verdicts}
    down = {key for key, s in signals.items() if s.down} | (verdicts.keys() & keys)
    fresh = {
        key: s
        for key, s in signals.items()
        if s.scraped and s.silent_s <= settings.stale_after_s and key in keys and key not in down
    }
    unbelieved = _unbelieved_capacities(pool, fresh, settings)
    for key in unbelieved:
        del fresh[key]
    capacities = _capacities(
        pool.endpoints,
        {k: s for k, s in signals.items() if s.scraped and k not in unbelieved},
        settings,
        slowness,
    )
    # No pod that is not known to be down has fresh metrics: a metrics outage, or a pool
    # none of whose pods has been scraped yet.
    all_stale = not fresh and any(endpoint_id(e) not in down for e in pool.endpoints)
    fail_open = all_stale and settings.all_stale == "fail_open"
    scores: dict[str, float] = {}
    for endpoint in pool.endpoints:
        key = endpoint_id(endpoint)
        if key in fresh:
            raw = _score(fresh[key], capacities[key], settings)
            previous = memory.get(key)
            scores[key] = (
                raw
                if previous is None
                else settings.smoothing * raw + (1 - settings.smoothing) * previous
            )
        elif key in memory:
            scores[key] = memory[key]
    # The session ring's weights: capacity alone (the largest is 1), clusters.py.
    capacity_exponent = settings.scorers.capacity
    # A pod without a score was never believed: out of rotation (the lowest weight), but
    # when the pool fails open and it is not down, on a par with the others.
    placeholder = (statistics.median(scores.values()) if scores else 1.0) if fail_open else 0.0
    healthy = [
        endpoint_id(e)
        for e in pool.endpoints
        if endpoint_id(e) not in draining
        and endpoint_id(e) not in down
        and (endpoint_id(e) in fresh or fail_open)
    ]
    activity = (
        _adapter_activity(pool.adapters, healthy, signals, adapter_activity)
        if pool.adapters
        else {}
    )
    placed = (
        _place_adapters(pool, healthy, signals, scores, placement, activity, settings)
        if pool.adapters
        else {}
    )
    loaded = _spilling(pool, healthy, fresh, capacities, spilled, settings)
    prefilling = {key for key in healthy if long_prompts.get(key, 0) > 0}
    # When every healthy pod would spill, the pool is full everywhere: moving keys would
    # only lose their prefixes.
    if loaded | prefilling >= set(healthy):
        loaded, prefilling = frozenset(), set()
    spilling = loaded | prefilling
    # A pod that spills its keys for load is taken out of the pool cluster's rotation the
    # same way (DEGRADED, and one long prompt's factor): unkeyed requests sent to a full
    # batch would wait for the slot its keys were moved off to spare.
    factor = settings.long_prompt_weight_factor
    weighed = {
        key: scores.get(key, 0.0 if key in down else placeholder)
        * factor ** (long_prompts.get(key, 0) + (key in loaded))
        for key in map(endpoint_id, pool.endpoints)
    }
    top = max(weighed.values(), default=1.0) or 1.0
    states = []
    for endpoint in pool.endpoints:
        key = endpoint_id(endpoint)
        if key in draining:
            health = Health.DRAINING
        elif key in down or (key not in fresh and not fail_open):
            health = Health.UNHEALTHY
        else:
            health = Health.HEALTHY
        observed = signals.get(key)
        states.append(
            EndpointState(
                address=endpoint.address,
                port=endpoint.port,
                name=endpoint.name,
                weight=_quantize(MAX_WEIGHT * weighed[key] / top),
                ring_weight=_quantize(MAX_WEIGHT * capacities[key] ** capacity_exponent)
                if pool.session_affinity
                else None,
                health=health,
                adapters=placed[key]
                if key in placed
                else tuple(sorted(observed.adapters))
                if observed is not None
                else (),
                hardware=endpoint.hardware,
                long_prompts=long_prompts.get(key, 0),
                spilling=key in spilling,
                verdict=verdicts.get(key),
            )
        )
    return ScoredPool(
        state=PoolState(name=pool.name, endpoints=tuple(states)),
        memory=scores,
        placement=placed,
        adapter_activity=activity,
        spilled=frozenset(loaded),
    )


def _adapter_activity(
    adapters: tuple[str, ...],
    healthy: list[str],
    signals: Mapping[str, PodSignals],
    previous: Mapping[str, float],
) -> dict[str, float]:
    """Each adapter's activity (adapters.py): a step towards 1 if a healthy pod runs it
    now, towards 0 if none does; none while no healthy pod has run an adapter (what ran
    before ran on other pods, and would steer the fresh placement, adapters.py)."""
    running: set[str] = set()
    ran = False
    for key in healthy:
        if (s := signals.get(key)) is not None:
            running.update(s.running_adapters if s.running_adapters is not None else s.adapters)
            ran = ran or bool(s.adapters or s.recent_adapters)
    if not ran:
        return dict.fromkeys(adapters, 0.0)
    return {
        adapter: (old := previous.get(adapter, 0.0))
        + _ACTIVITY_SMOOTHING * ((adapter in running) - old)
        for adapter in adapters
    }


def _place_adapters(
    pool: PoolConfig,
    healthy: list[str],
    signals: Mapping[str, PodSignals],
    scores: Mapping[str, float],
    previous: Mapping[str, tuple[str, ...]],
    activity: Mapping[str, float],
    settings: BalancingConfig,
) -> dict[str, tuple[str, ...]]:
    """Adapter placement (adapters.py) over the healthy pods.

    vLLM reports its slots only once it has served a LoRA request: a pod that has not yet
    is taken to have the pool's `adapter_slots`, else as many as the most any pod of the
    pool reports, so that adapters spread at a cold start instead of piling onto the first
    pod to report. With neither, pods keep their adapters as reported. With
    `adapter_slots`, the adapters are placed before the first LoRA request, so that where
    they go does not hang on which pods those requests happened to reach.
    """
    reported = [s.max_adapters for k in healthy if (s := signals.get(k)) and s.max_adapters]
    default_slots = pool.adapter_slots or max(reported, default=None)
    if default_slots is None or not any(k in signals for k in healthy):
        return {}
    names = {endpoint_id(e): e.ring_key for e in pool.endpoints}
    pods = {
        key: AdapterPod(
            slots=s.max_adapters or default_slots,
            load=s.running + s.waiting,
            waiting=s.waiting > settings.queue_slack,
            score=scores.get(key, 0.0),
            adapters=frozenset(s.adapters),
            running_adapters=frozenset(running),
            queued_adapters=frozenset(
                running & set(s.waiting_adapters) if s.waiting_adapters is not None else running
            ),
            recent_adapters=s.recent_adapters,
            name=names[key],
        )
        for key in healthy
        if (s := signals.get(key)) is not None
        for running in [set(s.running_adapters if s.running_adapters is not None else s.adapters)]
    }
    return place_adapters(pool.adapters, pods, previous, activity)
