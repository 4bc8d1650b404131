"""Per-pod Prometheus metrics, read at scrape time from the metrics store and the decision.

A custom collector rather than labelled gauges: the set of pods changes all the time, and a
collector reports exactly the pods known now, with no stale series left behind.

Every series names its pod so that it joins with the model server's own series: `endpoint`
(`IP:port`, as the server keys pods), `model_server_pod` and `model_server_namespace` (the
Kubernetes pod, for pods found there; else the endpoint's configured `name`, or its
`IP:port`, and ""), and `hardware` (its class, or ""). Not `pod`: it would clash with
the target label Prometheus gives the server's own pod (which keeps the name, and ours
becomes `exported_pod`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from xds_server.config import EndpointConfig, RoutingConfig
from xds_server.metrics.store import PodObservation
from xds_server.policy.signals import endpoint_id
from xds_server.policy.state import EndpointState, Health
from xds_server.telemetry.bands import DecisionView

__all__ = ["LABELS", "Observations", "PodCollector"]


class Observations(Protocol):
    """Every scraped pod's latest observation, by endpoint id (the pod metrics source)."""

    def observations(self) -> Mapping[str, PodObservation]: ...


LABELS = ("pool", "endpoint", "model_server_pod", "model_server_namespace", "hardware")
# Labels some families have besides the pod's (reasons come from a bounded set:
# policy/reasons.py CODES).
_EXTRA = {"verdict": ("reason",), "spilling": ("reason",), "state": ("state", "reason")}

# Each family: its key in `collect`, its name and its documentation.
_FAMILIES = {
    "kv": ("xds_pod_kv_cache_usage_ratio", "KV-cache use (0..1) the pod reported."),
    "waiting": ("xds_pod_requests_waiting", "Requests queued in the pod's engine."),
    "running": ("xds_pod_requests_running", "Requests running in the pod's engine."),
    "adapters": ("xds_pod_lora_adapters", "LoRA adapters the pod holds or is loading."),
    "weight": ("xds_pod_weight", "The EDS load-balancing weight sent to Envoy."),
    "ring": (
        "xds_pod_ring_weight",
        "The pod's weight in its pool's session-key table (pools with session affinity):"
        " its capacity's, cut while it spilled its keys too often (reason home_share).",
    ),
    "cached": (
        "xds_pod_cached_tokens_per_request",
        "Prompt tokens the pod's prefix cache saved per finished request, recently: what"
        " keeping a key on its pod is worth (affinity_min_cached_tokens).",
    ),
    "long": (
        "xds_pod_long_prompts",
        "Long prompts holding the pod: prefilling (access log), or in flight (load reports of"
        " Envoys that do not log); its weight is cut while they last.",
    ),
    "buckets": (
        "xds_pod_key_buckets",
        "Key buckets pinned to the pod (pools with balancing.key_homes buckets): the buckets"
        " of the keys it is home to.",
    ),
    "offers": (
        "xds_pod_key_offers",
        "Key buckets no pod holds that are offered to the pod by name (pools with"
        " balancing.key_homes buckets, when offers are narrower than the spares, or the"
        " bucket's pod is out of rotation): the new keys of those buckets go to it.",
    ),
    "spare": (
        "xds_pod_key_spare",
        "1 while keys not seen yet may go to the pod (pools with balancing.key_homes buckets:"
        " its pinned keys' load at most its share plus the slack, not spilling, and no more"
        " keys' first requests lately than another such pod took), else 0.",
    ),
    "healthy": ("xds_pod_healthy", "1 if the pod is in rotation (HEALTHY), else 0."),
    "spilling": (
        "xds_pod_spilling",
        "1 while the pod queues or prefills a long prompt: DEGRADED in its pool (nothing new"
        " while another pod is healthy) and its session keys sent to other pods, else 0"
        " (label reason: the spill rule, or none).",
    ),
    "state": (
        "xds_pod_state",
        "1 for the pod's state (label state: healthy, spilling, draining or unhealthy) and"
        " the first reason the policy gave for it (label reason, none without one;"
        " /debug/decision has every reason with its figures).",
    ),
    "verdict": (
        "xds_pod_verdict",
        "1 while the Envoys' load reports keep the pod out of rotation (label reason:"
        " stalled or failing); absent otherwise.",
    ),
    "age": ("xds_pod_metrics_age_seconds", "Age of the pod's last good metrics."),
    "errors": ("xds_pod_scrape_errors_in_a_row", "Failed scrapes since the last good one."),
}


def _configured(config: RoutingConfig | None) -> dict[tuple[str, str], EndpointConfig]:
    """Every endpoint of `config`, by pool and endpoint id."""
    if config is None:
        return {}
    return {(pool.name, endpoint_id(e)): e for pool in config.pools for e in pool.endpoints}


def _labels(pool: str, endpoint: EndpointState, configured: EndpointConfig | None) -> list[str]:
    """The values of LABELS for `endpoint` of `pool`: from its entry in the config in force
    when it has one (the namespace is known only there), else from the decided state (a
    config changed since the decision)."""
    if configured is not None:
        return [
            pool,
            endpoint.id,
            configured.pod_name,
            configured.namespace or "",
            configured.hardware or "",
        ]
    return [pool, endpoint.id, endpoint.ring_key, "", endpoint.hardware or ""]


class PodCollector(Collector):
    """xds_pod_* gauges: one series per pod of every GPU-aware pool."""

    def __init__(self, pods: Observations, decisions: DecisionView) -> None:
        self._pods = pods
        self._decisions = decisions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            key: GaugeMetricFamily(name, documentation, labels=[*LABELS, *_EXTRA.get(key, ())])
            for key, (name, documentation) in _FAMILIES.items()
        }
        observations = self._pods.observations()
        config = self._decisions.config
        configured = _configured(config)
        bucketed = {p.name for p in config.pools if config.bucket_homes(p)} if config else set()
        for pool in self._decisions.decision.pools.values():
            for endpoint in pool.endpoints:
                pod_id = endpoint.id
                labels = _labels(pool.name, endpoint, configured.get((pool.name, pod_id)))
                families["weight"].add_metric(labels, endpoint.weight)
                if endpoint.ring_weight is not None:
                    families["ring"].add_metric(labels, endpoint.ring_weight)
                families["long"].add_metric(labels, endpoint.long_prompts)
                families["healthy"].add_metric(
                    labels, 1.0 if endpoint.health is Health.HEALTHY else 0.0
                )
                families["spilling"].add_metric(
                    [*labels, endpoint.spill_reason or "none"], float(endpoint.spilling)
                )
                first = endpoint.reasons[0].code if endpoint.reasons else "none"
                families["state"].add_metric([*labels, endpoint.state, first], 1.0)
                families["adapters"].add_metric(labels, len(endpoint.adapters))
                if pool.name in bucketed:
                    families["buckets"].add_metric(labels, len(endpoint.key_buckets))
                    families["offers"].add_metric(labels, len(endpoint.key_offers))
                    families["spare"].add_metric(labels, float(endpoint.key_spare))
                if endpoint.verdict is not None:
                    families["verdict"].add_metric([*labels, endpoint.verdict], 1.0)
                observation = observations.get(pod_id)
                if observation is None:
                    continue
                families["errors"].add_metric(labels, observation.errors_in_a_row)
                if observation.cached_tokens_per_request is not None:
                    families["cached"].add_metric(labels, observation.cached_tokens_per_request)
                if observation.age_s is not None:
                    families["age"].add_metric(labels, observation.age_s)
                metrics = observation.metrics
                if metrics is not None:
                    families["waiting"].add_metric(labels, metrics.waiting)
                    families["running"].add_metric(labels, metrics.running)
                    if metrics.kv_usage is not None:
                        families["kv"].add_metric(labels, metrics.kv_usage)
        yield from families.values()
