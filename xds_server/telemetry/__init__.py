"""Every Prometheus metric the server exports, in one registry per server instance.

    registry.py    Telemetry: xDS streams and pushes, snapshots, config reloads, LRS, ALS
    build_info.py  xds_build_info, process_* and python_info
    scrape.py      ScrapeTelemetry: scrapes of model-server metrics pages
    kubernetes_api.py  KubernetesTelemetry: list/watch and Events
    pods.py        PodCollector: xds_pod_* per pod, read at scrape time
    bands.py       BandCollector: xds_band_* and admission's capacity (flow control)
    pools.py       PoolCollector: xds_pool_healthy_endpoints, read at scrape time (and /readyz)
    saturation.py  SaturationCollector: xds_pool_saturation_ratio and its parts (autoscaling)
    lrs_in_progress.py  InProgressCollector: xds_lrs_requests_in_progress, read at scrape time
    loop_lag.py    the event loop's lag and the garbage collector's pauses

The components that produce the numbers do not know Prometheus where they can avoid it:
the scraper and the watchers report through small observer protocols, and the collectors
read the controller's latest decision through a protocol, not the controller itself. The
docs/metrics.md lists every series.
"""

from xds_server.telemetry.registry import Telemetry

__all__ = ["Telemetry"]
