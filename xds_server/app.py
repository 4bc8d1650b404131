"""The composition root: every part of the server, built in order and started together.

    sources: config file or ConfigMap, Kubernetes, pod metrics ──┐
    xDS edge: LRS load reports, ALS long prompts ─┬ fleet_load ──┤
    peering: the other replicas' Envoys' load ────┘              ▼
    controller ── policy.decide ── snapshot_builder ── xds cache ── ADS, to every Envoy

`XdsApplication` is an async context manager so that the CLI, the local demo and the tests
start and stop exactly the same thing. What it opens is kept on an AsyncExitStack: a part
that fails to start closes every part opened before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType, TracebackType
from typing import Any

import grpc

from xds_server.admin import AdminServer, default_debug_port, make_admin_app, make_debug_app
from xds_server.clock import Clock, loop_clock
from xds_server.config import RoutingConfig
from xds_server.controller import Controller, HomeBuckets
from xds_server.envoy import names
from xds_server.envoy.listeners import LONG_PROMPT_LOG_INTERVAL_S, SESSION_KEY_LOG
from xds_server.errors import ConfigError, XdsServerError
from xds_server.fleet_load import EnvoyLoad
from xds_server.metrics.scraper import Scraper
from xds_server.metrics.store import MetricsStore
from xds_server.peering.kubernetes_peers import KubernetesPeers
from xds_server.peering.links import PeerLinks
from xds_server.peering.remote_clusters import RemoteClusters, pool_reports
from xds_server.peering.reports import (
    MAX_REPORTED_SESSION_KEYS,
    MAX_SESSION_KEYS,
    ReplicaReport,
    SessionKeysReport,
)
from xds_server.peering.service import PeeringServer
from xds_server.settings import ServerSettings, TlsSettings
from xds_server.sources.kubernetes import client as kubernetes_client
from xds_server.sources.kubernetes.discovery import KubernetesDiscovery
from xds_server.sources.pod_metrics import PodMetricsSource, follow_config
from xds_server.sources.routing_config import routing_config_documents
from xds_server.telemetry import Telemetry
from xds_server.telemetry.bands import BandCollector
from xds_server.telemetry.failover import FailoverCollector
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry
from xds_server.telemetry.loop_lag import timing_gc, watch_loop_lag
from xds_server.telemetry.pods import PodCollector
from xds_server.telemetry.pools import PoolCollector
from xds_server.telemetry.saturation import SaturationCollector
from xds_server.telemetry.scrape import ScrapeTelemetry
from xds_server.verdicts import PodVerdicts, run_probes
from xds_server.xds.access_logs import AccessLogServer, PrefillingPrompts
from xds_server.xds.ads import AdsServer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.identity import Authenticator, IdentityPolicy
from xds_server.xds.load_reports import LoadReports
from xds_server.xds.load_stats import LoadStatsServer
from xds_server.xds.nodes import NodeRegistry
from xds_server.xds.session_keys import SessionKeys
from xds_server.xds.tls import TlsCredentials, TlsFiles

__all__ = ["LoggedKeyCounts", "XdsApplication"]


_NO_KEYS: Mapping[str, Mapping[int, float]] = MappingProxyType({})
_NO_SERVED: Mapping[str, Mapping[int, str]] = MappingProxyType({})


class LoggedKeyCounts:
    """The controller's session keys (SessionKeysSource): per pool, each logged key hash's
    recent requests, this replica's own Envoys' and its peers' added up (peering/links.py).
    The own part is a new mapping when a pool gained a key or a key moved (the store's
    revision), or when keys were logged and `refresh_s` passed; the sum is a new mapping
    when either part is: otherwise the same object, so that a pool nobody sends keys to
    is decided as before, at no cost. `report` is the own part as peers are sent it.

    Mutable state: the revision and entry count read last, when, and what they gave."""

    def __init__(
        self,
        keys: SessionKeys,
        *,
        clock: Clock,
        refresh_s: float = 2.0,
        peers: Callable[[], Mapping[str, Mapping[int, float]]] | None = None,
        factors: Callable[[], dict[str, dict[str, float]]] | None = None,
        buckets: Callable[[], HomeBuckets] | None = None,
        peers_served_by: Callable[[], Mapping[str, Mapping[int, str]]] | None = None,
    ) -> None:
        self._keys = keys
        self._clock = clock
        self._refresh_s = refresh_s
        self._peers = peers
        self._factors = factors
        self._buckets = buckets
        self._peers_served_by = peers_served_by
        self._read: tuple[int, int] = (-1, -1)
        self._read_at = 0.0
        self._own: Mapping[str, Mapping[int, float]] = MappingProxyType({})
        self._served_by: Mapping[str, Mapping[int, str]] = MappingProxyType({})
        self._own_served_by: dict[str, dict[int, str]] = {}
        self._returns: Mapping[str, Mapping[str, float]] = MappingProxyType({})
        self._firsts: Mapping[str, Mapping[str, int]] = MappingProxyType({})
        self._served_from: tuple[object, object] = (None, None)
        self._report = SessionKeysReport()
        self._reported_from: tuple[object, object] | None = None
        self._added: tuple[object, object, Mapping[str, Mapping[int, float]]] = (
            None,
            None,
            self._own,
        )

    def own(self) -> Mapping[str, Mapping[int, float]]:
        """This replica's own Envoys' keys."""
        now = self._clock()
        read = (self._keys.revision, self._keys.entries)
        logged = read[1] != self._read[1] and now - self._read_at >= self._refresh_s
        if read[0] != self._read[0] or logged:
            self._read, self._read_at = read, now
            snapshot = self._keys.snapshot(now)
            self._own = MappingProxyType(
                {
                    pool: MappingProxyType({h: seen.count for h, seen in keys.items()})
                    for pool, keys in snapshot.items()
                }
            )
            self._own_served_by = {
                pool: {h: seen.endpoint for h, seen in keys.items() if seen.endpoint is not None}
                for pool, keys in snapshot.items()
            }
            self._returns = self._keys.return_shares()
        return self._own

    def returns(self) -> Mapping[str, Mapping[str, float]]:
        """Per pool, per pod, the share of the keyed requests it was sent that returned to
        it (KeyReturnsSource), as this replica's own Envoys logged them: a share, which any
        Envoy's sample of the traffic estimates (a replica without Envoys of its own has
        none, and judges affinity per request). Read with the own keys (`refresh_s`)."""
        self.own()
        return self._returns

    def first_requests(self, within_s: float) -> Mapping[str, Mapping[str, int]]:
        """Per pool, per pod, the keys whose first request on it this replica's own Envoys
        logged in the last `within_s` seconds (FirstRequestsSource): the same object while
        the counts are the same."""
        firsts = self._keys.first_requests(within_s)
        if firsts != self._firsts:
            self._firsts = firsts
        return self._firsts

    def served_by(self) -> Mapping[str, Mapping[int, str]]:
        """Per pool, the pod (endpoint id) each key was last served by (ServedBySource),
        as the own Envoys said or else as the peers' did: the same object while none
        moved. Read with the own keys (`refresh_s`)."""
        own = self.own()
        peers = self._peers_served_by() if self._peers_served_by is not None else _NO_SERVED
        if own is not self._served_from[0] or peers is not self._served_from[1]:
            served_by = {pool: dict(keys) for pool, keys in peers.items()}
            for pool, keys in self._own_served_by.items():
                served_by.setdefault(pool, {}).update(keys)
            if served_by != self._served_by:
                self._served_by = MappingProxyType(
                    {p: MappingProxyType(k) for p, k in served_by.items()}
                )
            self._served_from = (own, peers)
        return self._served_by

    def report(self) -> SessionKeysReport:
        """The own keys as peers are sent them (each pool's busiest, MAX_SESSION_KEYS at
        most and an even share of MAX_REPORTED_SESSION_KEYS), with this replica's key
        homes (`factors` and `buckets`: the controller's). The same object while they are
        the same."""
        own = self.own()
        factors = self._factors() if self._factors is not None else {}
        buckets, spares = self._buckets() if self._buckets is not None else ({}, {})
        homes = (factors, buckets, spares)
        last = self._reported_from
        if last is None or last[0] is not own or last[1] != homes:
            self._reported_from = (own, homes)
            share = min(MAX_SESSION_KEYS, MAX_REPORTED_SESSION_KEYS // max(1, len(own)))
            reported = {
                pool: heapq.nlargest(share, keys.items(), key=lambda i: i[1])
                for pool, keys in own.items()
            }
            self._report = SessionKeysReport(
                factors=factors,
                # Only where keys live in buckets: hash homes place by hash alone.
                served_by={
                    pool: {
                        h: self._own_served_by[pool][h]
                        for h, _ in keys
                        if h in self._own_served_by.get(pool, {})
                    }
                    for pool, keys in reported.items()
                    if pool in buckets
                },
                buckets=buckets,
                spares=spares,
                pools={
                    pool: tuple(sorted((h, round(c, 3)) for h, c in keys))
                    for pool, keys in reported.items()
                },
            )
        return self._report

    def __call__(self) -> Mapping[str, Mapping[int, float]]:
        own = self.own()
        peers = self._peers() if self._peers is not None else _NO_KEYS
        if own is not self._added[0] or peers is not self._added[1]:
            pools: dict[str, dict[int, float]] = {p: dict(k) for p, k in own.items()}
            for pool, keys in peers.items():
                counts = pools.setdefault(pool, {})
                for hashed, count in keys.items():
                    counts[hashed] = counts.get(hashed, 0.0) + count
            added = MappingProxyType({p: MappingProxyType(c) for p, c in pools.items()})
            self._added = (own, peers, added if peers else own)
        return self._added[2]


def _tls_files(tls: TlsSettings) -> TlsFiles:
    return TlsFiles(cert=tls.cert, key=tls.key, client_ca=tls.client_ca)


logger = logging.getLogger(__name__)


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


class XdsApplication:
    """The whole server. Use `async with XdsApplication(settings) as app:`; ports are then bound.

    Construction wires the parts and does no network I/O; `__aenter__` binds and starts
    them. `clock` is every part's clock (the event loop's by default).
    """

    def __init__(self, settings: ServerSettings, *, clock: Clock = loop_clock) -> None:
        self.settings = settings
        self._clock = clock
        self.telemetry = Telemetry()
        self.cache = SnapshotCache()
        self.registry = NodeRegistry(self.telemetry)
        # The xDS edge's view of the Envoys' load, per cluster name.
        self.load_reports = LoadReports(
            self.telemetry, clock=clock, known_clusters=self.cache.cluster_names
        )
        # A prefilling prompt not logged for 10 intervals lost its end with its stream.
        self.long_prompts = PrefillingPrompts(
            stale_s=10 * LONG_PROMPT_LOG_INTERVAL_S,
            clock=clock,
            known_clusters=self.cache.cluster_names,
        )
        # The session keys' hashes the Envoys log, per pool, for the key homes.
        self.session_keys = SessionKeys(
            header=names.SESSION_HEADER,
            pool_of=names.session_pool,
            telemetry=self.telemetry,
            known_clusters=self.cache.cluster_names,
            clock=clock,
        )
        # Mutual TLS on the gRPC port, and who may speak for an Envoy or a peer.
        self._tls = TlsCredentials(_tls_files(settings.tls)) if settings.tls is not None else None
        self._authenticator = Authenticator(
            tls=settings.tls is not None,
            policy=IdentityPolicy(
                envoy_identity=settings.tls.envoy_identity if settings.tls else None,
                peer_identity=settings.tls.peer_identity if settings.tls else None,
            ),
            registry=self.telemetry.registry,
        )
        self.peers = PeerLinks(
            replica=settings.replica,
            registry=self.telemetry.registry,
            clock=clock,
            credentials=self._tls.channel_credentials if self._tls is not None else None,
            server_name=settings.tls.peer_server_name if settings.tls is not None else None,
        )
        # Other clusters' gateways that pools fail over to, and their servers' summaries.
        self.remote_clusters = RemoteClusters(
            replica=settings.replica,
            registry=self.telemetry.registry,
            clock=clock,
            credentials=self._tls.channel_credentials if self._tls is not None else None,
            server_name=settings.tls.peer_server_name if settings.tls is not None else None,
        )
        # Pods judged by what the Envoys report of them; a verdict decides at once, and a
        # verdict or a suspicion wakes the probes.
        self._probe_wake = asyncio.Event()
        self.verdicts = PodVerdicts(
            lambda: self.controller.config,
            clock=clock,
            on_change=self._verdicts_changed,
            observe=lambda reason: self.telemetry.pod_verdicts.labels(reason).inc(),
            wake=self._probe_wake.set,
            unpaged=lambda key: self.pods.store.awaits_page(key),
        )
        self.load_reports.observe(self.verdicts)
        self.envoy_load = EnvoyLoad(
            self.load_reports,
            self.long_prompts,
            replica=settings.replica,
            registry=self.registry,
            peers=self.peers,
            verdicts=self.verdicts,
        )
        # The session keys this replica's Envoys log, and its peers' (policy/homes.py).
        self.logged_keys = LoggedKeyCounts(
            self.session_keys,
            clock=clock,
            peers=self.peers.session_keys,
            peers_served_by=self.peers.served_by,
            factors=lambda: self.controller.home_factors(),
            buckets=lambda: self.controller.home_buckets(),
        )
        store = MetricsStore()
        self.pods = PodMetricsSource(store, clock=clock)
        self.controller = Controller(
            cache=self.cache,
            telemetry=self.telemetry,
            signals=self.pods.signals,
            load=self.envoy_load,
            remotes=self.remote_clusters,
            session_keys=self.logged_keys,
            followed_homes=self.peers.followed_homes,
            served_by=self.logged_keys.served_by,
            key_returns=self.logged_keys.returns,
            first_requests=self.logged_keys.first_requests,
            followed_buckets=self.peers.followed_buckets,
            clock=clock,
        )
        self.load_reports.subscribe(self.controller.load_changed)
        self.long_prompts.subscribe(self.controller.load_changed)
        self.session_keys.subscribe(self.controller.keys_changed)
        self.peers.subscribe(self.controller.peers_changed)
        self.remote_clusters.subscribe(self.controller.peers_changed)
        self.registry.subscribe(self.controller.envoy_connected, self.controller.envoy_rejected)
        scrape_telemetry = ScrapeTelemetry(self.telemetry.registry)
        self.scraper = Scraper(
            store,
            on_update=self._metrics_changed,
            observe_error=scrape_telemetry.observe_error,
            observe_scrape=scrape_telemetry.observe_scrape,
            clock=clock,
        )
        self.telemetry.registry.register(PodCollector(self.pods, self.controller))
        self.telemetry.registry.register(BandCollector(self.controller, self.envoy_load))
        self.telemetry.registry.register(PoolCollector(self.controller))
        self.telemetry.registry.register(FailoverCollector(self.controller))
        self.telemetry.registry.register(SaturationCollector(self.pods, self.controller))
        self.discovery: KubernetesDiscovery | None = None
        self._kubernetes_api: Any = None
        self._kubernetes_telemetry: KubernetesTelemetry | None = None
        self._kubernetes_peers: KubernetesPeers | None = None
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
                watch=k.watch,
            )
            if settings.peers_selector is not None:
                self._kubernetes_peers = KubernetesPeers(
                    self._kubernetes_api,
                    namespace=k.namespace,
                    selector=settings.peers_selector,
                    port=settings.xds_port,
                    own_pod=settings.replica,
                    on_peers=self.peers.set_peers,
                    telemetry=self._kubernetes_telemetry,
                    watch=k.watch,
                )
        self._admin = AdminServer(
            make_admin_app(telemetry=self.telemetry, controller=self.controller),
            host=settings.admin_host,
            port=settings.admin_port,
        )
        self._debug = AdminServer(
            make_debug_app(
                registry=self.registry,
                cache=self.cache,
                controller=self.controller,
                discovery=self.discovery,
                load_reports=self.load_reports.to_json,
                fleet=self._fleet_json,
            ),
            host=settings.debug_host,
            port=(
                default_debug_port(settings.admin_port)
                if settings.debug_port is None
                else settings.debug_port
            ),
        )
        self._pools_reported: tuple[tuple[object, ...], ReplicaReport] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._grpc: grpc.aio.Server | None = None
        self._stack = contextlib.AsyncExitStack()
        self._state = _State.UNOPENED
        self.xds_port = 0

    @property
    def admin_port(self) -> int:
        return self._admin.port

    @property
    def debug_port(self) -> int:
        return self._debug.port

    @property
    def config_source(self) -> str:
        """Where the routing config comes from, for logs."""
        return self.settings.config_source

    def _metrics_changed(self, _pod_id: str) -> None:
        self.controller.metrics_changed()

    def _verdicts_changed(self) -> None:
        self.controller.verdicts_changed()
        self._probe_wake.set()

    def _fleet_json(self, node: str | None = None) -> dict[str, object]:
        """For /debug/nodes: the peers, the pods judged from the Envoys' reports, and the
        fleet's Envoys as the policy counts them (only `node`, when given)."""
        return {
            "replica": self.settings.replica,
            "peers": self.peers.to_json(),
            "verdicts": self.verdicts.to_json(),
            "remote_servers": self.remote_clusters.links.to_json(),
            "failover": {
                pool: plan.to_json() for pool, plan in self.controller.decision.failover.items()
            },
            **self.envoy_load.to_json(self.controller.config, self.controller.decision, node=node),
        }

    def _own_report(self) -> ReplicaReport:
        """What this replica's peers are told: its own Envoys' load."""
        return self.envoy_load.local_report(self.controller.config)

    def _pools_report(self) -> ReplicaReport:
        """What other clusters' servers are told: this cluster's pools (their health,
        saturation, capacity and failover), the same object while nothing changed."""
        decision, config = self.controller.decision, self.controller.config
        signals = self.pods.signals(self._clock())
        key = (config, decision, signals)
        cached = self._pools_reported
        if cached is not None and all(a is b for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        report = (
            pool_reports(
                config,
                replica=self.settings.replica,
                states=decision.pools,
                failover=decision.failover,
                signals=signals,
            )
            if config is not None
            else ReplicaReport(replica=self.settings.replica, pools={})
        )
        self._pools_reported = (key, report)
        return report

    async def __aenter__(self) -> XdsApplication:
        if self._state is not _State.UNOPENED:
            raise RuntimeError(f"Cannot open an XdsApplication that is {self._state.value}.")
        self._state = _State.OPENED
        async with contextlib.AsyncExitStack() as stack:
            if self._kubernetes_api is not None:
                stack.push_async_callback(asyncio.to_thread, self._kubernetes_api.close)
            await self._start_grpc(stack)
            await stack.enter_async_context(self.scraper)
            try:
                await self._admin.start()
            except OSError as exc:
                raise OSError(f"Cannot start the admin server: {exc.strerror}.") from exc
            stack.push_async_callback(self._admin.stop)
            try:
                await self._debug.start()
            except OSError as exc:
                raise OSError(f"Cannot start the debug server: {exc.strerror}.") from exc
            stack.push_async_callback(self._debug.stop)
            self._start_tasks()
            stack.push_async_callback(self._stop_tasks)
            stack.enter_context(timing_gc(self.telemetry))
            self.peers.set_peers(self.settings.peers)
            stack.push_async_callback(self.peers.close)
            stack.push_async_callback(self.remote_clusters.close)
            self._stack = stack.pop_all()
        s = self.settings
        logger.info(
            "xDS server listening on %s:%d (gRPC ADS, %s), admin on http://%s:%d, debug views"
            " on http://%s:%d, config from %s.",
            s.xds_host,
            self.xds_port,
            "mutual TLS" if s.tls is not None else "plaintext",
            s.admin_host,
            self.admin_port,
            s.debug_host,
            self.debug_port,
            self.config_source,
        )
        return self

    async def _start_grpc(self, stack: contextlib.AsyncExitStack) -> None:
        s = self.settings
        server = grpc.aio.server(
            options=[
                ("grpc.keepalive_time_ms", int(s.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout_s * 1000)),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
                # What one client may send: a message (gRPC's default, stated), and streams
                # at once on one connection (an Envoy opens three: ADS, LRS, ALS).
                ("grpc.max_receive_message_length", 4 * 1024 * 1024),
                ("grpc.max_concurrent_streams", 16),
            ]
        )
        server.add_generic_rpc_handlers(
            (
                AdsServer(
                    cache=self.cache, registry=self.registry, authenticator=self._authenticator
                ).generic_handler(),
                LoadStatsServer(
                    reports=self.load_reports,
                    interval_s=s.load_report_interval_s,
                    authenticator=self._authenticator,
                ).generic_handler(),
                AccessLogServer(
                    prompts=self.long_prompts,
                    telemetry=self.telemetry,
                    authenticator=self._authenticator,
                    session_keys=self.session_keys,
                    session_key_log=SESSION_KEY_LOG,
                ).generic_handler(),
                PeeringServer(
                    report=self._own_report,
                    pools=self._pools_report,
                    session_keys=self.logged_keys.report,
                    authenticator=self._authenticator,
                ).generic_handler(),
            )
        )
        address = f"{s.xds_host}:{s.xds_port}"
        try:
            if self._tls is not None:
                self.xds_port = server.add_secure_port(address, self._tls.server_credentials())
            else:
                self.xds_port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"Cannot bind the xDS gRPC server to {s.xds_host}:{s.xds_port}.") from exc
        await server.start()
        self._grpc = server
        stack.push_async_callback(server.stop, 1.0)

    def _start_tasks(self) -> None:
        self._tasks = [
            asyncio.create_task(self.controller.run(), name="controller"),
            asyncio.create_task(self._follow_config(), name="config-source"),
            asyncio.create_task(watch_loop_lag(self.telemetry), name="loop-lag"),
            asyncio.create_task(self.remote_clusters.run(), name="remote-clusters"),
            asyncio.create_task(
                run_probes(self.verdicts, self._probe_wake, clock=self._clock), name="probes"
            ),
        ]
        if self.discovery is not None:
            self._tasks.append(
                asyncio.create_task(self.discovery.run(), name="kubernetes-discovery")
            )
        if self._kubernetes_peers is not None:
            self._tasks.append(
                asyncio.create_task(self._kubernetes_peers.run(), name="kubernetes-peers")
            )

    async def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def serve_forever(self) -> None:
        """Run until cancelled. Raises XdsServerError, with the cause chained, if a task dies."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in done if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise XdsServerError(
                f"The {failed.get_name()} task failed: {failed.exception()!r}."
            ) from (failed.exception())
        raise XdsServerError("A background task stopped although nothing asked it to.")

    async def _follow_config(self) -> None:
        documents = routing_config_documents(
            self.settings,
            kubernetes_api=self._kubernetes_api,
            telemetry=self._kubernetes_telemetry,
            server_telemetry=self.telemetry,
        )
        async for item in documents:
            if isinstance(item, ConfigError):
                self.controller.reject(item)
            elif self.discovery is not None:
                # The cluster adds pools, endpoints and splits; discovery submits the result.
                self.discovery.set_base(item)
            else:
                self.submit_config(item)

    def submit_config(self, config: RoutingConfig) -> None:
        """Put `config` in force: what to scrape, and (debounced) what Envoy holds."""
        follow_config(self.scraper, config)
        self.remote_clusters.follow(config)
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

    async def kill(self) -> None:
        """Stop at once, as a killed process does for its Envoys: every xDS, LRS and ALS
        stream is cut with no grace and the port refuses; then the rest closes. (A normal
        exit gives streams a second to end.) For fault tests and benchmarks."""
        if self._grpc is not None:
            await self._grpc.stop(None)
        await self.__aexit__(None, None, None)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = _State.CLOSED
        await self._stack.aclose()
