"""Live pod metrics as an input of the policy: what to scrape, and the signals it yields.

The routing config says which endpoints belong to GPU-aware pools and which model server
they run; this module keeps the scraper's target list and limits in step with it and
turns the store's observations into the policy's `PodSignals`. Each target also names
the pod's health check on its serving port (`/health`; Triton's `/v2/health/ready`),
asked while a restarted pod's page is late (metrics/scraper.py, policy/health.py).

A pod with no verdict yet (not scraped yet) has no signals; one whose scrapes have only
failed has signals with `scraped` False. Either way it is not in rotation
(policy/scoring.py) until a page of its is read and believed: a pod is weighed by what it
says, and one that has said nothing believable must not take traffic on a placeholder.

Pages are distrusted (a pod's page decides its share of the pool's traffic): the scraper
reads at most `balancing.max_metrics_page_bytes` of one, the reader refuses values no pod
can have (metrics/engines.py), and `CapacityCheck` refuses a KV capacity far beyond the
pod's peers': over `balancing.max_capacity_ratio` times the median of the pool's other
pods of its hardware class, when there are `Tuning.min_capacity_peers` or more of them with a
believed capacity. A refused page is a failed scrape of kind `implausible`: counted,
logged once per streak with the value and the bound, and the pod's last good metrics age
out as for any failed scrape.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from types import MappingProxyType

from xds_server.clock import Clock, loop_clock
from xds_server.config import MetricNamesConfig, MetricSeries, RoutingConfig
from xds_server.errors import ImplausibleMetricsError
from xds_server.metrics.engines import MetricName, Overrides, PodMetrics
from xds_server.metrics.scraper import PageCheck, Scraper, ScrapeTarget
from xds_server.metrics.store import MetricsStore, PodObservation
from xds_server.policy.capacity import beyond_peers, capacity_peer_group
from xds_server.policy.signals import PodSignals, endpoint_id

__all__ = [
    "CapacityCheck",
    "PodMetricsSource",
    "follow_config",
    "overrides_of",
    "scrape_targets",
    "signals_of",
]


# Each engine's health check, on its serving port, where it is not `/health`.
_HEALTH_PATHS = {"triton": "/v2/health/ready"}


def _metrics_path(engine: str) -> str:
    """Where `engine` serves its Prometheus page: trtllm-serve's `/metrics` is JSON
    (iteration stats), its Prometheus page `/prometheus/metrics`."""
    return "/prometheus/metrics" if engine == "trtllm" else "/metrics"


def scrape_targets(config: RoutingConfig) -> dict[str, ScrapeTarget]:
    """Every endpoint of a GPU-aware pool, by endpoint id, with its metrics URL, engine and
    health check."""
    targets = {}
    for pool in config.pools:
        if not pool.weights_from_metrics:
            continue
        for endpoint in pool.endpoints:
            port = pool.metrics_port or endpoint.port
            host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
            engine = endpoint.engine or pool.engine
            health = _HEALTH_PATHS.get(engine, "/health")
            reading = config.metrics_of(pool, endpoint.engine or pool.engine)
            targets[endpoint_id(endpoint)] = ScrapeTarget(
                url=f"http://{host}:{port}{pool.metrics_path or _metrics_path(engine)}",
                engine=engine,
                by_name=config.balancing.scrape_by_name,
                overrides=overrides_of(reading.names),
                capacity_unit=reading.capacity_unit,
                tokens_per_block=reading.tokens_per_block,
                health_url=f"http://{host}:{endpoint.port}{health}",
            )
    return targets


def overrides_of(names: MetricNamesConfig) -> Overrides:
    """The config's metric names (`pools[].metrics.names`, `engine_metrics`) as the
    engine adapter's overrides: each logical metric set, to its candidates in order."""
    overrides: dict[str, tuple[MetricName, ...]] = {}
    for metric, value in names:
        if value is None:
            continue
        candidates = value if isinstance(value, tuple) else (value,)
        overrides[metric] = tuple(
            MetricName(c.name, c.labels) if isinstance(c, MetricSeries) else MetricName(c)
            for c in candidates
        )
    return overrides


def signals_of(observation: PodObservation) -> PodSignals | None:
    """The policy's view of one pod; None for a pod with no verdict yet, `scraped` False
    for one whose scrapes have all failed (both are out of rotation)."""
    metrics = observation.metrics
    if metrics is None:
        if observation.failing_for_s is None:
            return None
        return PodSignals(
            silent_s=observation.silent_s,
            down=observation.down,
            waiting=0,
            running=0,
            scraped=False,
            probation_s=observation.probation_s,
        )
    return PodSignals(
        silent_s=observation.silent_s,
        down=observation.down,
        probation_s=observation.probation_s,
        waiting=metrics.waiting,
        running=metrics.running,
        kv_usage=metrics.kv_usage,
        kv_capacity_tokens=metrics.kv_capacity_tokens,
        adapters=tuple(sorted({*metrics.lora_running, *(metrics.lora_waiting or ())})),
        running_adapters=tuple(sorted(metrics.lora_running)),
        # None: the engine's waiting list repeats its running one (engines.py); placement
        # then reads the pod's queue, not the list.
        waiting_adapters=(
            None if metrics.lora_waiting is None else tuple(sorted(metrics.lora_waiting))
        ),
        max_adapters=metrics.max_lora,
        recent_adapters=metrics.lora_recent,
        prefix_hit_rate=observation.prefix_hit_rate,
        cached_tokens_per_request=observation.cached_tokens_per_request,
        stalled_s=observation.stalled_s,
    )


class CapacityCheck:
    """The scraper's `PageCheck` for `config`: a pod's KV capacity against its peers'.

    Peers are the pods of the same pool and hardware class (`capacity_peer_group`; a pod
    whose class has a configured `hardware_capacity` is not compared: its KV capacity is
    not used). A page whose capacity is over `max_capacity_ratio` times the median of the
    other believed capacities of one of its groups, when there are `Tuning.min_capacity_peers` or
    more, raises `ImplausibleMetricsError`; a page that passes is remembered as the pod's
    believed capacity (the scraper stores it next). A peer's median thus costs a
    bisection per scrape, not a pass over the pool.

    Built afresh for each config (`follow_config`), seeded with the store's last good
    metrics. Mutable state: `_believed` (pod id -> its believed capacity) and `_ordered`
    (group -> the believed capacities of its pods, sorted); changed only by `__call__`.
    """

    def __init__(self, config: RoutingConfig, *, store: MetricsStore | None = None) -> None:
        self.ratio = config.balancing.max_capacity_ratio
        self._groups: dict[str, tuple[str, ...]] = {}
        self._min_peers: dict[str, int] = {}
        for pool in config.pools:
            if not pool.weights_from_metrics:
                continue
            for endpoint in pool.endpoints:
                group = capacity_peer_group(pool, endpoint, config.balancing)
                if group is not None:
                    self._min_peers[group] = config.tuning(pool).min_capacity_peers
                    key = endpoint_id(endpoint)
                    self._groups[key] = (*self._groups.get(key, ()), group)
        self._believed: dict[str, int] = {}
        self._ordered: dict[str, list[int]] = {}
        for pod_id in self._groups:
            observation = store.observation(pod_id, now=0.0) if store is not None else None
            if observation is not None and observation.metrics is not None:
                self._remember(pod_id, observation.metrics.kv_capacity_tokens)

    def __repr__(self) -> str:
        return f"<CapacityCheck pods={len(self._groups)} believed={len(self._believed)}>"

    def __call__(self, pod_id: str, metrics: PodMetrics) -> None:
        groups = self._groups.get(pod_id, ())
        capacity = metrics.kv_capacity_tokens
        if capacity:
            previous = self._believed.get(pod_id)
            for group in groups:
                ordered = self._ordered.get(group, [])
                median = beyond_peers(
                    capacity,
                    ordered,
                    previous,
                    ratio=self.ratio,
                    min_peers=self._min_peers[group],
                )
                if median is not None:
                    peers = len(ordered) - (previous is not None)
                    raise ImplausibleMetricsError(
                        "the KV cache capacity (tokens)",
                        capacity,
                        f"over {self.ratio:g} times the median ({median:g}) of its {peers} "
                        f"peers in pool {_describe(group)} (balancing.max_capacity_ratio)",
                    )
        if groups:
            self._remember(pod_id, capacity)

    def _remember(self, pod_id: str, capacity: int | None) -> None:
        previous = self._believed.pop(pod_id, None)
        for group in self._groups[pod_id]:
            ordered = self._ordered.setdefault(group, [])
            if previous is not None:
                del ordered[bisect.bisect_left(ordered, previous)]
            if capacity:
                bisect.insort(ordered, capacity)
        if capacity:
            self._believed[pod_id] = capacity


_: type[PageCheck] = CapacityCheck


def _describe(group: str) -> str:
    pool, _, hardware = group.partition("/")
    return f"{pool}, hardware class {hardware}" if hardware else f"{pool}, no hardware class"


def follow_config(scraper: Scraper, config: RoutingConfig) -> None:
    """Make `scraper` scrape what `config` makes GPU-aware, at its interval, with its
    limits and its peers' check; forget the rest."""
    balancing = config.balancing
    scraper.interval_s = balancing.scrape_interval_s
    scraper.quiet_interval_s = balancing.quiet_scrape_interval_s
    scraper.timeout_s = balancing.scrape_timeout_s
    scraper.max_page_bytes = balancing.max_metrics_page_bytes
    scraper.set_targets(scrape_targets(config))
    scraper.check = CapacityCheck(config, store=scraper.store)


class PodMetricsSource:
    """The pods' metrics as the policy and telemetry read them, from the scraper's store.

    `signals` is the controller's SignalsSource (ages at the `now` the controller decides
    at), `observations` telemetry's (ages now, on `clock`). Both clocks must be the
    scraper's.

    Signals do not depend on `now` (a failing pod's `silent_s` runs from its scrapes'
    times), so the same store revision gives the same mapping, the same object: the
    controller tells "no new signal" by identity, without reading 2,000 pods again.

    Mutable state: the last signals and the store revision they are of.
    """

    def __init__(self, store: MetricsStore, *, clock: Clock = loop_clock) -> None:
        self.store = store
        self._clock = clock
        self._signals: tuple[int, Mapping[str, PodSignals]] | None = None

    def signals(self, now: float) -> Mapping[str, PodSignals]:
        revision = self.store.revision
        if self._signals is None or self._signals[0] != revision:
            snapshot = self.store.snapshot(now)
            signals = {
                pod_id: s for pod_id, o in snapshot.items() if (s := signals_of(o)) is not None
            }
            self._signals = (revision, MappingProxyType(signals))
        return self._signals[1]

    def observations(self) -> Mapping[str, PodObservation]:
        return self.store.snapshot(self._clock())
