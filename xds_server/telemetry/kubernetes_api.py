"""The Kubernetes sources' Prometheus metrics: what the watchers and the Event recorder report.

The sources do not know Prometheus: watchers report through `WatchObserver`
(sources/kubernetes/watch.py, which checks that this class conforms), and this class turns
the reports into metrics in the server's registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["KubernetesTelemetry"]


class KubernetesTelemetry:
    """The Kubernetes sources' metrics, in `registry` (the server's own, as in
    `xds_server.telemetry`): the watchers' (`WatchObserver`) and the `EventRecorder`'s.

    `resource` labels are plurals, qualified by group for custom resources
    (`inferencepools.inference.networking.k8s.io`); two watchers of one resource (two
    namespaces) share its series, and the objects gauge then shows the last one to change.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.watch_events = Counter(
            "xds_kubernetes_watch_events",
            "Watch events received, by resource and type (ADDED, MODIFIED, DELETED, BOOKMARK).",
            ["resource", "type"],
            registry=registry,
        )
        self.relists = Counter(
            "xds_kubernetes_relists",
            "Full lists of a resource, by reason: initial, expired (a watch answered 410) or "
            "error (after a failed list or watch).",
            ["resource", "reason"],
            registry=registry,
        )
        self.watch_errors = Counter(
            "xds_kubernetes_watch_errors",
            "Failed lists and watches (not counting 410 Expired, which only means list again).",
            ["resource"],
            registry=registry,
        )
        self.objects = Gauge(
            "xds_kubernetes_objects",
            "Objects of a resource currently known from list and watch.",
            ["resource"],
            registry=registry,
        )
        self.events_recorded = Counter(
            "xds_kubernetes_events_recorded",
            "Kubernetes Events this server tried to create, by result (ok, error).",
            ["result"],
            registry=registry,
        )
        for result in ("ok", "error"):
            self.events_recorded.labels(result)

    def observe_event(self, resource: str, event_type: str) -> None:
        self.watch_events.labels(resource, event_type).inc()

    def observe_relist(self, resource: str, reason: str) -> None:
        self.relists.labels(resource, reason).inc()

    def observe_error(self, resource: str) -> None:
        self.watch_errors.labels(resource).inc()

    def observe_objects(self, resource: str, count: int) -> None:
        self.objects.labels(resource).set(count)

    def observe_recorded(self, *, ok: bool) -> None:
        self.events_recorded.labels("ok" if ok else "error").inc()
