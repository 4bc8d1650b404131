"""The server's own Prometheus metrics, in one registry per server instance.

A registry per instance (not prometheus-client's global one) lets several servers live in one
process, as they do in tests and in the local demo.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from xds_server.telemetry.build_info import register_build_info

__all__ = ["Telemetry"]

_PUSH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Telemetry:
    """Every metric the server exports; docs/metrics.md lists them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        register_build_info(r)
        self.connected_streams = Gauge(
            "xds_connected_streams", "ADS streams currently open.", ["protocol"], registry=r
        )
        self.responses = Counter(
            "xds_responses",
            "Discovery responses sent (pushes), by resource type.",
            ["type"],
            registry=r,
        )
        self.resources_sent = Counter(
            "xds_resources_sent", "Resources carried by discovery responses.", ["type"], registry=r
        )
        self.push_duration = Histogram(
            "xds_push_duration_seconds",
            "Time from a snapshot being set to an Envoy acknowledging the response built from it.",
            ["type"],
            buckets=_PUSH_BUCKETS,
            registry=r,
        )
        self.acks = Counter(
            "xds_acks", "Responses acknowledged (ACK), by type.", ["type"], registry=r
        )
        self.nacks = Counter(
            "xds_nacks", "Responses rejected (NACK), by type.", ["type"], registry=r
        )
        self.stale_nonces = Counter(
            "xds_stale_nonces",
            "Requests ignored because their nonce was stale.",
            ["type"],
            registry=r,
        )
        self.unknown_types = Counter(
            "xds_unknown_type_requests",
            "Requests for a resource type this server does not serve.",
            registry=r,
        )
        self.snapshot_version = Gauge(
            "xds_snapshot_version_info",
            "Always 1; labels carry the version of each resource type in each group's snapshot.",
            ["group", "type", "version"],
            registry=r,
        )
        self.snapshot_updates = Counter(
            "xds_snapshot_updates",
            "Snapshots stored with new content, by group.",
            ["group"],
            registry=r,
        )
        self.snapshot_build_duration = Histogram(
            "xds_snapshot_build_seconds",
            "Time to build and serialize a snapshot from the current inputs.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.config_reloads = Counter(
            "xds_config_reloads",
            "Routing config loads, by result (ok, error).",
            ["result"],
            registry=r,
        )
        self.config_last_reload_ok = Gauge(
            "xds_config_last_reload_successful",
            "1 if the latest routing config load succeeded.",
            registry=r,
        )
        self.config_warnings = Counter(
            "xds_config_warnings",
            "Warnings about routing configs accepted all the same, by reason "
            "(pool_without_endpoints: one per pool a config leaves without endpoints).",
            ["reason"],
            registry=r,
        )
        self.config_warnings.labels("pool_without_endpoints")
        self.spill_to_ring = Gauge(
            "xds_spill_to_ring_fallback",
            "1 while spilled session keys go to the next pod of the ring, not the pool, because"
            " an Envoy refused a spill listener (balancing.spill_to 'pool'; docs/routing.md).",
            registry=r,
        )
        self.lrs_streams = Gauge(
            "xds_lrs_streams", "Load reporting (LRS) streams currently open.", registry=r
        )
        self.lrs_reports = Counter(
            "xds_lrs_reports", "Load reports received from Envoys over LRS.", registry=r
        )
        self.lrs_unknown_clusters = Counter(
            "xds_lrs_unknown_clusters",
            "Clusters named in load reports that this server never pushed (dropped).",
            registry=r,
        )
        self.lrs_refused_reports = Counter(
            "xds_lrs_refused_reports",
            "Load reports refused whole: they named more clusters than the server pushed"
            " plus 1,000.",
            registry=r,
        )
        self.lrs_implausible_reports = Counter(
            "xds_lrs_implausible_reports",
            "Times an Envoy's load report claimed more requests in flight on a pool than the"
            " pool's pods hold beyond the other Envoys' reports (counted once per Envoy and"
            " pool while it lasts); the excess is not believed.",
            registry=r,
        )
        self.pod_verdicts = Counter(
            "xds_pod_verdicts",
            "Pods taken out of rotation for what the Envoys' load reports show of them, by"
            " reason: stalled (requests in flight, none finishing) or failing.",
            ["reason"],
            registry=r,
        )
        self.als_dropped_entries = Counter(
            "xds_als_dropped_entries",
            "Access log entries dropped: an unknown cluster, or a stream over its bound.",
            ["reason"],
            registry=r,
        )
        self.als_streams = Gauge(
            "xds_als_streams",
            "Access log (ALS) streams currently open: Envoys logging long prompts or session"
            " keys.",
            registry=r,
        )
        self.als_entries = Counter(
            "xds_als_entries",
            "Upstream log entries of long prompts received, by type (UpstreamPoolReady: "
            "started, UpstreamEnd: ended).",
            ["type"],
            registry=r,
        )
        self.session_key_entries = Counter(
            "xds_session_key_entries",
            "Upstream log entries of keyed requests taken into the session keys' store.",
            registry=r,
        )
        self.session_key_dropped_entries = Counter(
            "xds_session_key_dropped_entries",
            "Upstream log entries of keyed requests dropped, by reason: no_key, oversized_key,"
            " unknown_cluster, not_session.",
            ["reason"],
            registry=r,
        )
        self.session_keys = Gauge(
            "xds_session_keys",
            "Session keys (their hashes) tracked per pool, seen in the session-key log.",
            ["pool"],
            registry=r,
        )
        self.session_key_returns = Gauge(
            "xds_session_key_returns",
            "Share of the pool's recent keyed requests (half-life 10 s) that went back to the"
            " pod their key was last served by: what affinity's figure is judged per.",
            ["pool"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "xds_event_loop_lag_seconds",
            "How late a periodic timer fires on the server's event loop: how long the loop"
            " was busy with something else (everything, ADS included, waits that long).",
            buckets=_PUSH_BUCKETS,
            registry=r,
        )
        self.loop_lag_max = Gauge(
            "xds_event_loop_lag_max_seconds",
            "The largest event-loop lag since the server started.",
            registry=r,
        )
        self.gc_pause = Histogram(
            "xds_gc_pause_seconds",
            "Python's cyclic garbage collector's pauses, by generation (they stop the event"
            " loop like any other work).",
            ["generation"],
            buckets=_PUSH_BUCKETS,
            registry=r,
        )
        self._version_labels: dict[tuple[str, str], str] = {}

    def record_snapshot_version(self, *, group: str, type_name: str, version: str) -> None:
        """Point xds_snapshot_version_info at `version`, dropping the series of the old one."""
        old = self._version_labels.get((group, type_name))
        if old == version:
            return
        if old is not None:
            self.snapshot_version.remove(group, type_name, old)
        self.snapshot_version.labels(group, type_name, version).set(1)
        self._version_labels[(group, type_name)] = version
