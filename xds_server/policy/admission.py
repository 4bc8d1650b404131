"""Flow control: how many requests of each band a pool admits, and how long a refused one
should wait (pure: no I/O).

Envoy enforces the limits per request: each band has its own cluster (`<pool>/<band>`) whose
circuit breaker admits at most `max_requests` at once, changed at runtime (RTDS) so that
connections and counters survive. This module decides the numbers, every scrape interval,
from the pods' metrics and the Envoys' load reports:

- **capacity** C: requests the pool's ready pods serve at once without queueing. Per pod,
  its concurrency (`flow_control.pod_concurrency` by hardware class, else
  `default_pod_concurrency`); a pod that reports waiting requests, or a KV cache about to
  preempt, is full at what it runs now, so it counts as that.
- **strict priority**, with R_b the requests of band b in flight over every Envoy (LRS)
  and T = C − H the places Standard and Sheddable may fill (H, `critical_headroom` × C, is
  kept free for Critical requests to start at once instead of queueing in a full pod
  until the next update): Critical is admitted while any pod is ready (no limit: a
  critical request is never refused; "no ready pod" is Envoy's 503); Standard may grow to
  T − R_critical − R_sheddable; Sheddable to u·T − R_critical − R_standard − A_standard,
  where u (`sheddable_utilization`) keeps Sheddable to the spare of a pool that is not
  nearly full (so it is refused first) and A_standard is what Standard is expected to
  take before the next update (its admission rate times the horizon). An admitted
  request cannot be taken back and runs for many seconds, so each budget leaves room for
  what the others already run: the pods never hold more than T plus Critical.
- **sharing**: the budget is fleet-wide (the load of every Envoy, whichever server replica
  it reports to: xds_server/peering); each Envoy enforces its own part, which follows its
  demand (shares.py). Places held back for replicas this one cannot see (`reserved`) are
  kept out of the split, and an Envoy the decision does not know yet (it just connected)
  enforces the floor until the next decision names it (at once: a new ADS stream is
  decided on without delay).
- **tenants' fair shares**: with weighted tenants, each limited band's budget is split
  over its lanes by weight first (tenant_shares.py: one lane per weighted tenant and the
  shared lane for everyone else's requests), and each lane's part over the Envoys by their
  demand of that lane, so the band's budget holds over all its lanes together.
- **Retry-After**: the expected time until the band has a free place: the requests ahead
  of it beyond capacity, plus one, over the pool's completion rate; bounded by
  `retry_after_min_s` and `retry_after_max_s` and rounded up to a coarse ladder so the
  value (a route property, pushed over RDS) changes seldom.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from xds_server.config import BANDS, TENANT_BANDS, Band, FlowControlConfig
from xds_server.policy.shares import EnvoyDemand, split_budget
from xds_server.policy.tenant_shares import SHARED_LANE, LaneDemand, split_band
from xds_server.tuning import RETRY_AFTER_LADDER_S, UNLIMITED, Tuning

__all__ = [
    "BandLoad",
    "PodCapacity",
    "PodsHeld",
    "PoolAdmission",
    "TenantAdmission",
    "admit",
    "nominal_concurrency",
    "plausible_load",
    "pod_capacity",
]

_NO_DEMAND = EnvoyDemand()
_DEFAULT_TUNING = Tuning()


@dataclass(frozen=True, kw_only=True)
class PodCapacity:
    """One ready pod's part in its pool's capacity."""

    hardware: str | None
    running: float
    waiting: float
    kv_usage: float | None = None


@dataclass(frozen=True, kw_only=True)
class BandLoad:
    """What the Envoys report for a pool (LRS): summed over the fleet's Envoys, and per
    Envoy (node id) the demand its part of each band's budget follows."""

    in_flight: Mapping[Band, int]
    # Requests of the pool completed per second, all bands together.
    completions_per_s: float = 0.0
    # Requests of each band sent to the pods per second (what a band takes between updates).
    issued_per_s: Mapping[Band, float] = field(default_factory=dict)
    by_envoy: Mapping[str, Mapping[Band, EnvoyDemand]] = field(default_factory=dict)
    # Per Envoy and band, the demand of each lane (the band's cluster per lane: "pool",
    # "session", "long"), when the pool has more than one.
    lanes_by_envoy: Mapping[str, Mapping[Band, Mapping[str, EnvoyDemand]]] = field(
        default_factory=dict
    )
    # Per Envoy and band (of TENANT_BANDS), the demand of each weighted tenant's lane; with
    # weighted tenants, `by_envoy` and `lanes_by_envoy` are the shared lanes' alone, and
    # `in_flight` and `issued_per_s` count every lane.
    tenants_by_envoy: Mapping[str, Mapping[Band, Mapping[str, EnvoyDemand]]] = field(
        default_factory=dict
    )


@dataclass(frozen=True, kw_only=True)
class TenantAdmission:
    """One band's split over its lanes (tenant_shares.py): by lane (tenant name, or
    SHARED_LANE), its requests in flight over the fleet, its fleet-wide limit, and what
    each Envoy enforces of it."""

    in_flight: Mapping[str, int]
    parts: Mapping[str, int]
    # By node id, then tenant, the Envoys that use a tenant's lane (the shared lane's part
    # is the Envoy's band limit).
    by_envoy: Mapping[str, Mapping[str, int]]
    # What every other Envoy enforces for each tenant: the floor.
    floor: Mapping[str, int]


@dataclass(frozen=True, kw_only=True)
class PoolAdmission:
    """A pool's admission: per band, the fleet-wide budget, the limit each Envoy enforces
    and the Retry-After."""

    capacity: int
    # Requests in flight over every Envoy, per band.
    in_flight: Mapping[Band, int]
    # Requests each band may have in flight over the fleet (Critical: UNLIMITED).
    budget: Mapping[Band, int]
    # The limit of an Envoy not in `by_envoy` (one that just connected): the floor.
    max_requests: Mapping[Band, int]
    # Each known Envoy's limits, by node id, and the demand they follow.
    by_envoy: Mapping[str, Mapping[Band, int]]
    retry_after_s: Mapping[Band, int]
    demand: Mapping[str, Mapping[Band, EnvoyDemand]] = field(default_factory=dict)
    # Envoys whose reported requests in flight were not believed (`plausible_load`): node
    # id -> the requests taken off their report.
    clipped: Mapping[str, int] = field(default_factory=dict)
    # Each known Envoy's band limit split over the band's lanes, when it has several.
    by_lane: Mapping[str, Mapping[Band, Mapping[str, int]]] = field(default_factory=dict)
    # With weighted tenants: each band's (of TENANT_BANDS) split over its lanes.
    tenants: Mapping[Band, TenantAdmission] = field(default_factory=dict)

    def tenant_limit(self, node_id: str | None, band: Band, tenant: str) -> int:
        """What `tenant`'s lane of `band` admits at Envoy `node_id` (None: one not named
        yet); 0 for a tenant this admission has no part for."""
        split = self.tenants.get(band)
        if split is None:
            return 0
        own = split.by_envoy.get(node_id, {}) if node_id is not None else {}
        return own.get(tenant, split.floor.get(tenant, 0))

    def limits_of(self, node_id: str) -> Mapping[Band, int]:
        """The limits Envoy `node_id` enforces."""
        return self.by_envoy.get(node_id, self.max_requests)

    def lane_limit(self, node_id: str | None, band: Band, lane: str) -> int:
        """What lane `lane` of `band` admits at Envoy `node_id` (None: one not named
        yet): its part of the Envoy's band limit, so that the lanes together admit the
        band's limit, not that many times it."""
        if node_id is None:
            return self.max_requests[band]
        split = self.by_lane.get(node_id, {}).get(band, {})
        return split.get(lane, self.limits_of(node_id)[band])


def nominal_concurrency(hardware: str | None, *, settings: FlowControlConfig) -> int:
    """Requests a pod of class `hardware` serves at once when it is not full: the class's
    `pod_concurrency`, else `default_pod_concurrency`."""
    return settings.pod_concurrency.get(hardware or "", settings.default_pod_concurrency)


def pod_capacity(
    pod: PodCapacity, *, settings: FlowControlConfig, tuning: Tuning = _DEFAULT_TUNING
) -> int:
    """Requests `pod` serves at once now (module docstring)."""
    slots = nominal_concurrency(pod.hardware, settings=settings)
    full = pod.waiting > 0 or (
        pod.kv_usage is not None and pod.kv_usage >= tuning.admission_kv_full
    )
    return max(0, min(slots, math.floor(pod.running))) if full else slots


def _ladder(seconds: float, *, settings: FlowControlConfig) -> int:
    bounded = min(max(seconds, settings.retry_after_min_s), settings.retry_after_max_s)
    step = RETRY_AFTER_LADDER_S[
        min(bisect.bisect_left(RETRY_AFTER_LADDER_S, bounded), len(RETRY_AFTER_LADDER_S) - 1)
    ]
    return int(min(max(step, settings.retry_after_min_s), settings.retry_after_max_s))


def admit(
    pods: Iterable[PodCapacity],
    *,
    load: BandLoad,
    settings: FlowControlConfig,
    horizon_s: float,
    reserved: float = 0.0,
    held: PodsHeld | None = None,
    tuning: Tuning = _DEFAULT_TUNING,
) -> PoolAdmission:
    """The pool's admission from its ready `pods` and the Envoys' `load`. `horizon_s` is
    how long these limits stand before the next ones arrive (what Standard may take
    meanwhile is kept from Sheddable; an Envoy's demand counts its arrivals over it).
    `reserved` (0 to 1) is the part of each budget held back for Envoys this replica
    cannot see (server replicas it has no word from). `held`, what all the pool's pods
    hold by their metrics, is what the reports must be consistent with (plausible_load)."""
    capacity = sum(pod_capacity(p, settings=settings, tuning=tuning) for p in pods)
    load, clipped = plausible_load(load, held, tuning) if held is not None else (load, {})
    in_flight: dict[Band, int] = {band: max(0, load.in_flight.get(band, 0)) for band in BANDS}
    critical, standard, sheddable = (in_flight[b] for b in BANDS)
    target = capacity * (1 - settings.critical_headroom)
    # Admitted requests cannot be taken back, so every band's budget leaves room for what
    # the others already run: the pods never hold more than `target` (plus Critical).
    # Standard may take all that is free; Sheddable what is free beyond what Standard is
    # expected to take before the next limits.
    standard_arrivals = load.issued_per_s.get("standard", 0.0) * horizon_s
    budgets = {
        "standard": target - critical - sheddable,
        "sheddable": settings.sheddable_utilization * target
        - critical
        - standard
        - standard_arrivals,
    }
    ahead = {"critical": 0, "standard": critical, "sheddable": critical + standard}
    budget: dict[Band, int] = {"critical": UNLIMITED}
    max_requests: dict[Band, int] = {"critical": UNLIMITED}
    by_envoy: dict[str, dict[Band, int]] = {node: {"critical": UNLIMITED} for node in load.by_envoy}
    retry_after: dict[Band, int] = {}
    tenants: dict[Band, TenantAdmission] = {}
    for band in BANDS:
        if band != "critical":
            budget[band] = math.ceil(max(0.0, budgets[band]))
            seen = math.floor(budget[band] * (1 - min(1.0, max(0.0, reserved))))
            max_requests[band] = min(settings.envoy_floor, seen)
            demands = {node: bands.get(band, _NO_DEMAND) for node, bands in load.by_envoy.items()}
            weights = settings.tenants.weighted()
            if weights and band in TENANT_BANDS:
                tenants[band] = _tenant_split(
                    seen, band, demands, load, weights, settings=settings, horizon_s=horizon_s
                )
                seen = tenants[band].parts[SHARED_LANE]
            limits = split_budget(seen, demands, floor=settings.envoy_floor, horizon_s=horizon_s)
            for node, limit in limits.items():
                by_envoy[node][band] = limit
        # Requests that must finish before this band has a place: those ahead of it and of
        # its own beyond capacity, and one more for the refused request itself.
        waiting_for = max(0, ahead[band] + in_flight[band] - capacity) + 1
        if capacity == 0:
            seconds = float(settings.retry_after_max_s)  # nothing serves: no drain to expect
        elif load.completions_per_s > 0:
            seconds = waiting_for / load.completions_per_s
        else:
            seconds = float(waiting_for)  # no completions seen yet: about one per second
        retry_after[band] = _ladder(seconds, settings=settings)
    by_lane: dict[str, dict[Band, dict[str, int]]] = {}
    for node, bands in load.lanes_by_envoy.items():
        for band, lanes in bands.items():
            if band != "critical" and len(lanes) > 1 and node in by_envoy:
                # The Envoy's part, split again over the band's lanes (each its own
                # cluster and circuit breaker) the same way, one place each first.
                by_lane.setdefault(node, {})[band] = split_budget(
                    by_envoy[node][band], lanes, floor=1, horizon_s=horizon_s
                )
    return PoolAdmission(
        capacity=capacity,
        budget=budget,
        max_requests=max_requests,
        by_envoy=by_envoy,
        demand=load.by_envoy,
        by_lane=by_lane,
        retry_after_s=retry_after,
        in_flight=in_flight,
        clipped=clipped,
        tenants=tenants,
    )


def _tenant_split(
    budget: int,
    band: Band,
    shared: Mapping[str, EnvoyDemand],
    load: BandLoad,
    weights: Mapping[str, float],
    *,
    settings: FlowControlConfig,
    horizon_s: float,
) -> TenantAdmission:
    """`band`'s `budget` split over its lanes by weight (tenant_shares.py), and each
    tenant's part over the Envoys by their demand of it (the shared lane's part is split
    by the caller, as a band's budget is without tenants). `shared` is each Envoy's
    demand of the shared lane. Every lane's floor over the fleet is one Envoy floor per
    Envoy, so that each Envoy can start a lane's first request at once.

    An Envoy with no demand of a tenant keeps only the floor of its lane (`floor`, what
    an Envoy not named gets too), and the rest of the tenant's part goes to the Envoys
    that use it: at fleet size most Envoys carry no traffic of most tenants, and this
    keeps the split's work to those that do (a tenant whose clients come to a new Envoy
    waits there for the next decision beyond the floor)."""
    per_tenant: dict[str, dict[str, EnvoyDemand]] = {tenant: {} for tenant in weights}
    for node, bands in load.tenants_by_envoy.items():
        for tenant, demand in bands.get(band, {}).items():
            used = demand.in_flight > 0 or demand.arrivals_per_s > 0
            if used and tenant in per_tenant and node in load.by_envoy:
                per_tenant[tenant][node] = demand
    lanes = {
        tenant: LaneDemand(
            weight=weights[tenant],
            in_flight=sum(max(0, d.in_flight) for d in envoys.values()),
            arrivals_per_s=sum(max(0.0, d.arrivals_per_s) for d in envoys.values()),
        )
        for tenant, envoys in per_tenant.items()
    }
    lanes[SHARED_LANE] = LaneDemand(
        weight=1.0,
        in_flight=sum(max(0, d.in_flight) for d in shared.values()),
        arrivals_per_s=sum(max(0.0, d.arrivals_per_s) for d in shared.values()),
    )
    fleet = max(1, len(load.by_envoy))
    parts = split_band(budget, lanes, floor=settings.envoy_floor * fleet, horizon_s=horizon_s)
    floor = {tenant: min(settings.envoy_floor, parts[tenant] // fleet) for tenant in weights}
    by_envoy: dict[str, dict[str, int]] = {}
    for tenant, envoys in per_tenant.items():
        idle = fleet - len(envoys)
        limits = split_budget(
            parts[tenant] - floor[tenant] * idle,
            envoys,
            floor=floor[tenant],
            horizon_s=horizon_s,
        )
        for node, limit in limits.items():
            by_envoy.setdefault(node, {})[tenant] = limit
    return TenantAdmission(
        in_flight={lane: d.in_flight for lane, d in lanes.items()},
        parts=parts,
        by_envoy=by_envoy,
        floor=floor,
    )


@dataclass(frozen=True)
class PodsHeld:
    """The requests all of a pool's pods run and queue by their metrics (ready or not: a
    stuck or draining pod holds requests too), and how many pods that is."""

    requests: float
    pods: int


def plausible_load(
    load: BandLoad, held: PodsHeld, tuning: Tuning = _DEFAULT_TUNING
) -> tuple[BandLoad, dict[str, int]]:
    """`load` with the reports no pod could have made true taken down, and what was taken
    off each (node id -> requests).

    Every request an Envoy has in flight on the pool is on one of its pods, so all of them
    together hold at most what the pods say they run and queue, give or take the requests in
    transit and a scrape's lag (`Tuning.plausible_margin` of it, `plausible_slack_per_pod`
    per pod). Beyond that, the largest reports are not believed, largest first, until the
    rest fit: each is set to what the pods hold beyond the others' reports (at least 0), its
    bands and demand scaled alike, so one Envoy claiming a thousand Critical requests
    changes neither the budgets nor the shares of the others."""
    if not load.by_envoy:
        return load, {}
    allowance = (
        held.requests * (1 + tuning.plausible_margin) + tuning.plausible_slack_per_pod * held.pods
    )
    totals = {node: _reported(load, node) for node in load.by_envoy}
    grand = sum(totals.values())
    clipped: dict[str, int] = {}
    for node in sorted(totals, key=lambda n: (-totals[n], n)):
        if grand <= allowance:
            break
        others = grand - totals[node]
        believed = max(0, math.floor(held.requests - others))
        if believed >= totals[node]:
            break
        clipped[node] = totals[node] - believed
        grand = others + believed
        totals[node] = believed
    if not clipped:
        return load, {}
    return _believed(load, clipped, totals), clipped


def _reported(load: BandLoad, node: str) -> int:
    """The requests Envoy `node` reports in flight on the pool: every band and lane."""
    tenants = load.tenants_by_envoy.get(node, {})
    return sum(demand.in_flight for demand in load.by_envoy[node].values()) + sum(
        demand.in_flight for lanes in tenants.values() for demand in lanes.values()
    )


def _believed(load: BandLoad, clipped: Mapping[str, int], totals: Mapping[str, int]) -> BandLoad:
    """`load` with each `clipped` Envoy's report scaled down to its believed `totals`."""
    in_flight = dict(load.in_flight)
    by_envoy = dict(load.by_envoy)
    by_lane = dict(load.lanes_by_envoy)
    by_tenant = dict(load.tenants_by_envoy)
    for node in clipped:
        ratio = totals[node] / (totals[node] + clipped[node])
        bands = {band: _scaled(demand, ratio) for band, demand in load.by_envoy[node].items()}
        for band, demand in bands.items():
            in_flight[band] = in_flight.get(band, 0) - (
                load.by_envoy[node][band].in_flight - demand.in_flight
            )
        by_envoy[node] = bands
        if node in by_tenant:
            tenants = {
                band: {tenant: _scaled(d, ratio) for tenant, d in lanes.items()}
                for band, lanes in by_tenant[node].items()
            }
            for band, lanes in tenants.items():
                in_flight[band] = in_flight.get(band, 0) - sum(
                    by_tenant[node][band][tenant].in_flight - d.in_flight
                    for tenant, d in lanes.items()
                )
            by_tenant[node] = tenants
        if node in by_lane:
            by_lane[node] = {
                band: {lane: _scaled(d, ratio) for lane, d in lanes.items()}
                for band, lanes in by_lane[node].items()
            }
    return BandLoad(
        in_flight=in_flight,
        completions_per_s=load.completions_per_s,
        issued_per_s=load.issued_per_s,
        by_envoy=by_envoy,
        lanes_by_envoy=by_lane,
        tenants_by_envoy=by_tenant,
    )


def _scaled(demand: EnvoyDemand, ratio: float) -> EnvoyDemand:
    return EnvoyDemand(
        in_flight=math.floor(demand.in_flight * ratio),
        arrivals_per_s=demand.arrivals_per_s * ratio,
    )
