"""Live pod metrics as an input of the policy: what to scrape, and the signals it yields.

The routing config says which endpoints belong to GPU-aware pools and which model server
they run; this module keeps the scraper's target list in step with it and turns the store's
observations into the policy's `PodSignals`. A pod that has never answered counts as stale
once it has been failing for `stale_after_s` (or at once when it refuses connections), so a
dead pod does not keep the median weight forever.
"""

from __future__ import annotations

from collections.abc import Mapping

from xds_server.clock import Clock, loop_clock
from xds_server.config import RoutingConfig
from xds_server.metrics.scraper import Scraper, ScrapeTarget
from xds_server.metrics.store import MetricsStore, PodObservation
from xds_server.policy.scoring import PodSignals, endpoint_id

__all__ = ["PodMetricsSource", "follow_config", "scrape_targets", "signals_of"]


def scrape_targets(config: RoutingConfig) -> dict[str, ScrapeTarget]:
    """Every endpoint of a GPU-aware pool, by endpoint id, with its metrics URL and engine."""
    targets = {}
    for pool in config.pools:
        if not pool.weights_from_metrics:
            continue
        for endpoint in pool.endpoints:
            port = pool.metrics_port or endpoint.port
            host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
            targets[endpoint_id(endpoint)] = ScrapeTarget(
                url=f"http://{host}:{port}{pool.metrics_path}",
                engine=endpoint.engine or pool.engine,
            )
    return targets


def signals_of(observation: PodObservation) -> PodSignals | None:
    """The policy's view of one pod; None for a pod with no verdict yet."""
    metrics = observation.metrics
    if metrics is None:
        if observation.failing_for_s is None:
            return None
        return PodSignals(
            silent_s=observation.silent_s, down=observation.down, waiting=0, running=0
        )
    return PodSignals(
        silent_s=observation.silent_s,
        down=observation.down,
        waiting=metrics.waiting,
        running=metrics.running,
        kv_usage=metrics.kv_usage,
        kv_capacity_tokens=metrics.kv_capacity_tokens,
        adapters=tuple(sorted({*metrics.lora_running, *metrics.lora_waiting})),
        running_adapters=tuple(sorted(metrics.lora_running)),
        waiting_adapters=tuple(sorted(metrics.lora_waiting)),
        max_adapters=metrics.max_lora,
        recent_adapters=metrics.lora_recent,
        prefix_hit_rate=observation.prefix_hit_rate,
    )


def follow_config(scraper: Scraper, config: RoutingConfig) -> None:
    """Make `scraper` scrape what `config` makes GPU-aware, at its interval; forget the rest."""
    scraper.interval_s = config.balancing.scrape_interval_s
    scraper.timeout_s = config.balancing.scrape_timeout_s
    scraper.set_targets(scrape_targets(config))


class PodMetricsSource:
    """The pods' metrics as the policy and telemetry read them, from the scraper's store.

    `signals` is the controller's SignalsSource (ages at the `now` the controller decides
    at), `observations` telemetry's (ages now, on `clock`). Both clocks must be the
    scraper's.
    """

    def __init__(self, store: MetricsStore, *, clock: Clock = loop_clock) -> None:
        self.store = store
        self._clock = clock

    def signals(self, now: float) -> Mapping[str, PodSignals]:
        snapshot = self.store.snapshot(now)
        return {pod_id: s for pod_id, o in snapshot.items() if (s := signals_of(o)) is not None}

    def observations(self) -> Mapping[str, PodObservation]:
        return self.store.snapshot(self._clock())
