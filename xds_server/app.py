"""The running server: config source, pod-metrics scraper, controller, ADS gRPC server and
admin HTTP, together.

`XdsApplication` is an async context manager so that the CLI, the local demo and the tests
start and stop exactly the same thing.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from xds_server.admin import AdminServer, make_admin_app
from xds_server.band_telemetry import BandCollector
from xds_server.config import Band, RoutingConfig
from xds_server.controller import Controller
from xds_server.envoy.listeners import LONG_PROMPT_LOG_INTERVAL_S
from xds_server.errors import ConfigError, XdsServerError
from xds_server.metrics import MetricsStore, Scraper, ScrapeTelemetry
from xds_server.pod_telemetry import PodCollector
from xds_server.policy.admission import BandLoad
from xds_server.sources.config_file import watch_config_file
from xds_server.sources.kubernetes import client as kubernetes_client
from xds_server.sources.kubernetes.configmap import watch_configmap
from xds_server.sources.kubernetes.discovery import KubernetesDiscovery
from xds_server.sources.kubernetes.events import EventRecorder
from xds_server.sources.kubernetes.watch import KubernetesTelemetry
from xds_server.sources.pod_metrics import PodMetricsSource
from xds_server.telemetry import Telemetry
from xds_server.xds.access_logs import AccessLogServer, PrefillingPrompts
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.load_reports import LoadReports
from xds_server.xds.load_stats import LoadStatsServer
from xds_server.xds.nodes import NodeRegistry
from xds_server.xds.server import AdsServer

__all__ = ["EnvoyLoad", "KubernetesSettings", "ServerSettings", "XdsApplication"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class KubernetesSettings:
    """Where the server finds pods, Inference Extension objects and its ConfigMap."""

    # The server's own namespace: its ConfigMap and Events live here.
    namespace: str
    # Where pod selectors (without their own namespaces) and InferencePools are looked for.
    watch_namespaces: tuple[str, ...]
    # The ConfigMap holding the routing config; None reads `ServerSettings.config_path`.
    configmap: str | None = None
    # The API server: None means in-cluster, else the kubeconfig; `api_host` is for tests.
    api_host: str | None = None
    kubeconfig: Path | None = None
    # ResourceWatcher keyword options (backoff ladder, watch timeout), for tests.
    watcher_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Process-level settings (flags), as opposed to the routing config (file or ConfigMap)."""

    # The routing config file; unused when the config comes from a ConfigMap.
    config_path: Path | None = None
    kubernetes: KubernetesSettings | None = None
    xds_host: str = "127.0.0.1"
    xds_port: int = 18000
    admin_host: str = "127.0.0.1"
    admin_port: int = 9000
    config_poll_s: float = 1.0
    # gRPC keepalive: notice a dead Envoy (or a dead path to it) within about a minute.
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    # How often Envoys send load reports (LRS): requests in flight and rates per cluster.
    # Where a long prompt starts, the policy learns sooner from the access log (ALS).
    load_report_interval_s: float = 0.25


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


class EnvoyLoad:
    """The controller's LoadSource: what every connected Envoy reports over LRS, and the
    long prompts they log while those prefill (ALS).

    All Envoys count, whatever their node group: the pods' capacity is shared by all.
    """

    def __init__(self, reports: LoadReports, prompts: PrefillingPrompts) -> None:
        self._reports = reports
        self._prompts = prompts

    def band_load(self, clusters: Mapping[Band, Sequence[str]]) -> BandLoad:
        rates = {band: [self._reports.rates(c) for c in cs] for band, cs in clusters.items()}
        return BandLoad(
            in_flight={
                band: sum(self._reports.in_progress(c) for c in cs)
                for band, cs in clusters.items()
            },
            completions_per_s=sum(r.successful_per_s for rs in rates.values() for r in rs),
            issued_per_s={band: sum(r.issued_per_s for r in rs) for band, rs in rates.items()},
        )

    def envoys(self) -> int:
        return max(1, len(self._reports.nodes()))

    def long_prompts_by_endpoint(self, clusters: Sequence[str]) -> dict[str, int]:
        """From the Envoys that log long prompts, those still prefilling; from the others,
        those in flight as their last load report says (it cannot tell prefill from
        decode)."""
        logging_nodes = self._prompts.nodes()
        total: dict[str, int] = {}
        for cluster in clusters:
            for counts in (
                self._prompts.prefilling(cluster),
                self._reports.in_progress_by_endpoint(cluster, excluding=logging_nodes),
            ):
                for key, count in counts.items():
                    total[key] = total.get(key, 0) + count
        return total


class XdsApplication:
    """The whole server. Use `async with XdsApplication(settings) as app:`; ports are then bound."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.telemetry = Telemetry()
        self.cache = SnapshotCache()
        self.registry = NodeRegistry(self.telemetry)
        self.load_reports = LoadReports(
            self.telemetry, on_change=lambda clusters: self.controller.load_changed(clusters)
        )
        # A prefilling prompt not logged for 10 intervals lost its end with its stream.
        self.long_prompts = PrefillingPrompts(
            stale_s=10 * LONG_PROMPT_LOG_INTERVAL_S,
            on_change=lambda clusters: self.controller.load_changed(clusters),
        )
        scrape_telemetry = ScrapeTelemetry(self.telemetry.registry)
        self.scraper = Scraper(
            MetricsStore(),
            on_update=lambda _pod_id: self.controller.metrics_changed(),
            observe_error=scrape_telemetry.observe_error,
            observe_scrape=scrape_telemetry.observe_scrape,
        )
        self.pods = PodMetricsSource(self.scraper)
        self.controller = Controller(
            cache=self.cache,
            telemetry=self.telemetry,
            signals=self.pods.signals,
            load=EnvoyLoad(self.load_reports, self.long_prompts),
        )
        self.telemetry.registry.register(PodCollector(self.pods, self.controller))
        self.telemetry.registry.register(BandCollector(self.controller, self.load_reports))
        self.discovery: KubernetesDiscovery | None = None
        self._kubernetes_api: Any = None
        if settings.kubernetes is not None:
            k = settings.kubernetes
            self._kubernetes_api = kubernetes_client.api_client(
                kubeconfig=k.kubeconfig, host=k.api_host
            )
            self._kubernetes_telemetry = KubernetesTelemetry(self.telemetry.registry)
            self.discovery = KubernetesDiscovery(
                self._kubernetes_api,
                namespaces=k.watch_namespaces,
                on_config=self.submit_config,
                telemetry=self._kubernetes_telemetry,
                watcher_options=k.watcher_options,
            )
        elif settings.config_path is None:
            raise ValueError("ServerSettings needs a config_path, or Kubernetes with a ConfigMap.")
        self._grpc: grpc.aio.Server | None = None
        self._admin = AdminServer(
            make_admin_app(
                telemetry=self.telemetry,
                registry=self.registry,
                cache=self.cache,
                controller=self.controller,
                discovery=self.discovery,
                load_reports=self.load_reports.to_json,
            ),
            host=settings.admin_host,
            port=settings.admin_port,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._state = _State.UNOPENED
        self.xds_port = 0

    @property
    def admin_port(self) -> int:
        return self._admin.port

    async def __aenter__(self) -> XdsApplication:
        if self._state is not _State.UNOPENED:
            raise RuntimeError(f"Cannot open an XdsApplication that is {self._state.value}.")
        self._state = _State.OPENED
        s = self.settings
        self._grpc = grpc.aio.server(
            options=[
                ("grpc.keepalive_time_ms", int(s.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout_s * 1000)),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ]
        )
        self._grpc.add_generic_rpc_handlers(
            (
                AdsServer(cache=self.cache, registry=self.registry).generic_handler(),
                LoadStatsServer(
                    reports=self.load_reports, interval_s=s.load_report_interval_s
                ).generic_handler(),
                AccessLogServer(
                    prompts=self.long_prompts, telemetry=self.telemetry
                ).generic_handler(),
            )
        )
        try:
            self.xds_port = self._grpc.add_insecure_port(f"{s.xds_host}:{s.xds_port}")
        except RuntimeError as exc:
            raise OSError(f"Cannot bind the xDS gRPC server to {s.xds_host}:{s.xds_port}.") from exc
        await self._grpc.start()
        await self.scraper.__aenter__()
        try:
            await self._admin.start()
        except OSError as exc:
            await self._grpc.stop(grace=None)
            raise OSError(f"Cannot start the admin server: {exc.strerror}.") from exc
        self._tasks = [
            asyncio.create_task(self.controller.run(), name="controller"),
            asyncio.create_task(self._follow_config(), name="config-source"),
        ]
        if self.discovery is not None:
            self._tasks.append(
                asyncio.create_task(self.discovery.run(), name="kubernetes-discovery")
            )
        logger.info(
            "xDS server listening on %s:%d (gRPC ADS), admin on http://%s:%d, config from %s.",
            s.xds_host,
            self.xds_port,
            s.admin_host,
            self.admin_port,
            self.config_source,
        )
        return self

    async def serve_forever(self) -> None:
        """Run until cancelled. Raises XdsServerError, with the cause chained, if a task dies."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in done if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise XdsServerError(
                f"The {failed.get_name()} task failed: {failed.exception()!r}."
            ) from (failed.exception())
        raise XdsServerError("A background task stopped although nothing asked it to.")

    @property
    def config_source(self) -> str:
        """Where the routing config comes from, for logs."""
        k = self.settings.kubernetes
        if k is not None and k.configmap is not None:
            return f"ConfigMap {k.namespace}/{k.configmap}"
        return str(self.settings.config_path)

    def _config_documents(self) -> AsyncIterator[RoutingConfig | ConfigError]:
        k = self.settings.kubernetes
        if k is not None and k.configmap is not None:
            return watch_configmap(
                self._kubernetes_api,
                namespace=k.namespace,
                name=k.configmap,
                events=EventRecorder(self._kubernetes_api, telemetry=self._kubernetes_telemetry),
                telemetry=self._kubernetes_telemetry,
                watcher_options=k.watcher_options,
            )
        assert self.settings.config_path is not None
        return watch_config_file(self.settings.config_path, interval_s=self.settings.config_poll_s)

    async def _follow_config(self) -> None:
        async for item in self._config_documents():
            if isinstance(item, ConfigError):
                self.controller.reject(item)
            elif self.discovery is not None:
                # The cluster adds pools, endpoints and splits; discovery submits the result.
                self.discovery.set_base(item)
            else:
                self.submit_config(item)

    def submit_config(self, config: RoutingConfig) -> None:
        """Put `config` in force: what to scrape, and (debounced) what Envoy holds."""
        self.pods.follow(config)
        self.controller.submit(config)

    async def wait_ready(self, within_s: float = 10.0) -> None:
        """Wait until the first snapshot is stored (raises TimeoutError with the config error)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while not self.controller.ready:
            if loop.time() > deadline:
                raise TimeoutError(
                    f"no snapshot after {within_s} s: {self.controller.last_error or 'no config'}"
                )
            await asyncio.sleep(0.02)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = _State.CLOSED
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.scraper.aclose()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self._admin.stop()
        if self._kubernetes_api is not None:
            await asyncio.to_thread(self._kubernetes_api.close)
