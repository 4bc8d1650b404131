"""The fleet's load, from Envoy's cluster names to the policy's pools, bands and pods.

The xDS edge (xds/load_reports.py, xds/access_logs.py) keeps what this replica's Envoys
report per cluster name, as Envoy names them; the peer links (xds_server/peering) keep what
the other replicas' Envoys report. This is the one place both are merged and those names
translated (envoy/names.py says what each cluster carries), so the policy reads load by
pool, band, Envoy and endpoint id, over every Envoy of the fleet whichever replica it
reports to. Clusters the config does not name are not read, nor passed on to peers.

An Envoy known twice (it moved between replicas, and the old one's last report still
lists it) counts once, from the best source: its load reports arriving here, else a
peer's report that has its load (the newest), else its ADS stream here (no load yet).

Hundreds of Envoys times a hundred pools make this the costliest input of a decision, and
most of the time nothing in it changes. So what it made is kept and handed out again, the
same objects, while its sources say nothing changed: the load reports', the prompts' and
the ADS streams' revisions, and the peers' reports, compared as values. A reader (the
controller) then tells "no new load" by identity.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from xds_server.config import BANDS, Band, PoolConfig, RoutingConfig
from xds_server.envoy import names
from xds_server.peering.reports import ClusterReport, EnvoyReport, ReplicaReport
from xds_server.policy.admission import BandLoad
from xds_server.policy.decision import Decision, FleetLoad, PoolLoad
from xds_server.policy.shares import EnvoyDemand
from xds_server.telemetry.bands import BandTotals
from xds_server.xds.access_logs import PrefillingPrompts
from xds_server.xds.load_reports import LoadReports
from xds_server.xds.nodes import NodeRegistry

__all__ = ["EnvoyLoad", "PeerView", "VerdictView"]

_NO_DEMAND = EnvoyDemand()


class VerdictView(Protocol):
    """The pods judged, and found slower than their peers, from this replica's load
    reports (verdicts.py)."""

    revision: int

    def of_pool(self, pool: str) -> Mapping[str, str]: ...

    def slowness_of_pool(self, pool: str) -> Mapping[str, int]: ...


class PeerView(Protocol):
    """What the other server replicas report of their Envoys (peering/links.py)."""

    def reports(self) -> list[tuple[ReplicaReport, float]]: ...

    def reserved(self) -> float: ...


def _lanes(config: RoutingConfig, pool: PoolConfig) -> tuple[dict[Band, list[str]], list[str]]:
    """The pool's band clusters (with flow control) and long-prompt clusters."""
    bands = names.band_clusters(config, pool) if config.flow_control.enabled else {}
    return bands, list(names.long_prompt_clusters(config, pool))


def _tenant_lanes(config: RoutingConfig) -> set[str]:
    """Every weighted tenant's clusters of every pool."""
    return {
        cluster
        for pool in config.pools
        for lanes in names.tenant_clusters(config, pool).values()
        for cluster in lanes.values()
    }


class EnvoyLoad:
    """The controller's LoadSource (and telemetry's BandTotalsSource): what every Envoy of
    the fleet reports over LRS, and the long prompts they log while those prefill (ALS).

    All Envoys count, whatever their node group: the pods' capacity is shared by all.
    """

    def __init__(
        self,
        reports: LoadReports,
        prompts: PrefillingPrompts,
        *,
        replica: str = "xds-server",
        registry: NodeRegistry | None = None,
        peers: PeerView | None = None,
        verdicts: VerdictView | None = None,
    ) -> None:
        self._reports = reports
        self._verdicts = verdicts
        self._prompts = prompts
        self._replica = replica
        self._registry = registry
        self._peers = peers
        # The report of each Envoy known over ADS only, as last made.
        self._ads_only: dict[str, EnvoyReport] = {}
        # The last local report and fleet load, with what they were made from.
        self._local: tuple[object, ReplicaReport] | None = None
        self._fleet: tuple[object, FleetLoad] | None = None

    # -- this replica's Envoys -------------------------------------------------------------

    def local_report(self, config: RoutingConfig | None) -> ReplicaReport:
        """This replica's own Envoys' load on `config`'s lanes (what its peers are sent):
        the same object as last time while none of its sources changed."""
        if config is None:
            return ReplicaReport(replica=self._replica)
        idle_logs = self._prompts.idle_nodes()
        key = (
            config,
            self._reports.revision,
            idle_logs,
            self._registry.revision if self._registry is not None else 0,
        )
        if idle_logs is not None and self._local is not None and self._local[0] == key:
            return self._local[1]
        report = self._local_report(config)
        self._local = (key, report)
        return report

    def _local_report(self, config: RoutingConfig) -> ReplicaReport:
        long_prompt: set[str] = set()
        wanted: set[str] = set()
        for pool in config.pools:
            bands, long = _lanes(config, pool)
            long_prompt.update(long)
            wanted.update(long, *bands.values())
        wanted |= _tenant_lanes(config)
        prefilling: dict[str, dict[str, dict[str, int]]] = {n: {} for n in self._prompts.nodes()}
        for cluster in sorted(long_prompt):
            for node_id, counts in self._prompts.prefilling_by_node(cluster).items():
                if node_id in prefilling:
                    prefilling[node_id][cluster] = counts
        envoys: dict[str, EnvoyReport] = {}
        # Newest stream last: a node on two LRS streams (a reconnect) counts as its newest.
        for node in sorted(self._reports.nodes(), key=lambda n: n.stream_id):
            clusters = {
                name: ClusterReport(
                    in_progress=load.in_progress,
                    by_endpoint=dict(load.by_endpoint) if name in long_prompt else {},
                    issued_per_s=load.rates.issued_per_s,
                    successful_per_s=load.rates.successful_per_s,
                    dropped_per_s=load.rates.dropped_per_s,
                )
                for name, load in sorted(node.clusters.items())
                if name in wanted
            }
            envoys[node.node_id] = EnvoyReport(
                node_id=node.node_id,
                reports_load=True,
                clusters=clusters,
                prefilling=prefilling.get(node.node_id),
            )
        ads_only = {}
        for record in self._registry.streams() if self._registry is not None else ():
            if record.node_id and record.node_id not in envoys:
                logs = prefilling.get(record.node_id)
                # Validated once per Envoy, not per change: at fleet size this ran 500
                # times for every Envoy that connected.
                known = self._ads_only.get(record.node_id)
                if known is None or known.prefilling != logs:
                    known = EnvoyReport(node_id=record.node_id, prefilling=logs)
                envoys[record.node_id] = ads_only[record.node_id] = known
        self._ads_only = ads_only
        return ReplicaReport(replica=self._replica, envoys=tuple(envoys[n] for n in sorted(envoys)))

    # -- the fleet ---------------------------------------------------------------------------

    def envoys(self, config: RoutingConfig | None) -> dict[str, tuple[str, EnvoyReport]]:
        """Every Envoy of the fleet once (module docstring), with where it was heard of:
        "local", or the peer replica's name."""
        ranked: dict[str, tuple[int, str, EnvoyReport]] = {}

        def offer(rank: int, source: str, envoy: EnvoyReport) -> None:
            current = ranked.get(envoy.node_id)
            if current is None or rank > current[0]:
                ranked[envoy.node_id] = (rank, source, envoy)

        for envoy in self.local_report(config).envoys:
            offer(3 if envoy.reports_load else 1, "local", envoy)
        for report, _received_at in self._peers.reports() if self._peers is not None else ():
            for envoy in report.envoys:
                offer(2 if envoy.reports_load else 0, report.replica, envoy)
        return {node: (source, envoy) for node, (_, source, envoy) in sorted(ranked.items())}

    def fleet_load(self, config: RoutingConfig) -> FleetLoad:
        """The fleet's load on `config`'s pools: the same object as last time while none
        of its sources changed."""
        peers = self._peers
        key = (
            config,
            self.local_report(config),
            tuple(report for report, _ in peers.reports()) if peers is not None else (),
            peers.reserved() if peers is not None else 0.0,
            self._verdicts.revision if self._verdicts is not None else 0,
        )
        if self._fleet is not None and self._fleet[0] == key:
            return self._fleet[1]
        load = self._fleet_load(config)
        self._fleet = (key, load)
        return load

    def _fleet_load(self, config: RoutingConfig) -> FleetLoad:
        envoys = [envoy for _, envoy in self.envoys(config).values()]
        pools = {}
        for pool in config.pools:
            bands, long = _lanes(config, pool)
            pools[pool.name] = PoolLoad(
                bands=_band_load(
                    bands, envoys, config.lanes(pool), names.tenant_clusters(config, pool)
                )
                if bands
                else BandLoad(in_flight={}),
                long_prompts=_long_prompts(long, envoys),
                verdicts=self._verdicts.of_pool(pool.name) if self._verdicts is not None else {},
                slowness=self._verdicts.slowness_of_pool(pool.name)
                if self._verdicts is not None
                else {},
            )
        return FleetLoad(
            pools=pools, reserved=self._peers.reserved() if self._peers is not None else 0.0
        )

    def to_json(
        self, config: RoutingConfig | None, decision: Decision, *, node: str | None = None
    ) -> dict[str, object]:
        """For /debug/nodes: the budget held back for unseen replicas, each pool's
        fleet-wide budgets (and its weighted tenants' parts), and every Envoy counted (only
        `node`, when given: at 500 Envoys and 100 pools the whole list is 24 MB), where it
        was heard of, its demand and its limits per pool and band (and per weighted
        tenant)."""
        admissions = decision.admissions
        return {
            "reserved": self._peers.reserved() if self._peers is not None else 0.0,
            "budgets": {
                pool: {
                    "budget": dict(a.budget),
                    "in_flight": dict(a.in_flight),
                    # Weighted tenants: each band's lanes' parts and requests in flight.
                    **(
                        {
                            "tenants": {
                                band: {"parts": dict(t.parts), "in_flight": dict(t.in_flight)}
                                for band, t in a.tenants.items()
                            }
                        }
                        if a.tenants
                        else {}
                    ),
                }
                for pool, a in sorted(admissions.items())
            },
            "envoys": [
                {
                    "node_id": node_id,
                    "heard_from": source,
                    "reports_load": envoy.reports_load,
                    "limits": {pool: dict(a.limits_of(node_id)) for pool, a in admissions.items()},
                    "tenant_limits": {
                        pool: {
                            band: {t: a.tenant_limit(node_id, band, t) for t in split.floor}
                            for band, split in a.tenants.items()
                        }
                        for pool, a in admissions.items()
                        if a.tenants
                    },
                    "demand": {
                        pool: {
                            band: {"in_flight": d.in_flight, "arrivals_per_s": d.arrivals_per_s}
                            for band, d in a_load.items()
                        }
                        for pool, a in admissions.items()
                        if (a_load := a.demand.get(node_id)) is not None
                    },
                }
                for node_id, (source, envoy) in self.envoys(config).items()
                if node is None or node_id == node
            ],
        }

    def band_totals(self, config: RoutingConfig) -> dict[tuple[str, Band], BandTotals]:
        """Admitted and refused requests per (pool, band) of `config` with flow control, by
        this replica's Envoys since it started."""
        totals = {}
        for pool in config.pools:
            clusters = names.band_clusters(config, pool)
            tenants = names.tenant_clusters(config, pool)
            for band in BANDS:
                lanes = [*clusters[band], *tenants.get(band, {}).values()]
                totals[(pool.name, band)] = BandTotals(
                    admitted=self._reports.admitted(lanes), refused=self._reports.refused(lanes)
                )
        return totals

    def tenant_totals(self, config: RoutingConfig) -> dict[tuple[str, Band, str], BandTotals]:
        """Admitted and refused requests per (pool, band, weighted tenant) of `config`, by
        this replica's Envoys since it started (the tenant's lane)."""
        return {
            (pool.name, band, tenant): BandTotals(
                admitted=self._reports.admitted([cluster]),
                refused=self._reports.refused([cluster]),
            )
            for pool in config.pools
            for band, lanes in names.tenant_clusters(config, pool).items()
            for tenant, cluster in lanes.items()
        }


def _demand(loads: Iterable[ClusterReport]) -> EnvoyDemand:
    """What `loads` (one Envoy's, of some clusters) ask for: in flight, and sent or
    refused per second."""
    loads = list(loads)
    return EnvoyDemand(
        in_flight=sum(load.in_progress for load in loads),
        arrivals_per_s=sum(load.issued_per_s + load.dropped_per_s for load in loads),
    )


def _band_load(
    clusters: Mapping[Band, list[str]],
    envoys: Iterable[EnvoyReport],
    lanes: Sequence[str],
    tenants: Mapping[Band, Mapping[str, str]],
) -> BandLoad:
    """In-flight requests per band (summed over the band's clusters, one per lane and one
    per weighted tenant, and every Envoy), the completions per second of all of them
    together, and each Envoy's demand per band (and per lane, with several; and per
    tenant, the tenants' lanes apart from the band's shared ones).

    An Envoy that reports nothing of the pool (ADS only so far, or no traffic) shares one
    record of no demand: at fleet size most Envoys carry no traffic of most pools, and
    this runs for every pool and Envoy."""
    sums = _Sums(in_flight=dict.fromkeys(clusters, 0), issued=dict.fromkeys(clusters, 0.0))
    idle: dict[Band, EnvoyDemand] = dict.fromkeys(clusters, _NO_DEMAND)
    idle_lanes = {band: dict.fromkeys(lanes, _NO_DEMAND) for band in clusters}
    pool_clusters = [c for names_of_band in clusters.values() for c in names_of_band]
    pool_clusters += [c for lanes_of_band in tenants.values() for c in lanes_of_band.values()]
    by_envoy: dict[str, dict[Band, EnvoyDemand]] = {}
    by_lane: dict[str, dict[Band, dict[str, EnvoyDemand]]] = {}
    by_tenant: dict[str, dict[Band, dict[str, EnvoyDemand]]] = {}
    for envoy in envoys:
        reported = envoy.clusters
        if not reported or not any(c in reported for c in pool_clusters):
            by_envoy[envoy.node_id] = idle
            if len(lanes) > 1:
                by_lane[envoy.node_id] = idle_lanes
            continue
        demands: dict[Band, EnvoyDemand] = {}
        for band, names_of_band in clusters.items():
            demands[band] = sums.add(band, [reported[c] for c in names_of_band if c in reported])
            if len(lanes) > 1:
                by_lane.setdefault(envoy.node_id, {})[band] = {
                    lane: _demand([reported[c]] if c in reported else [])
                    for lane, c in zip(lanes, names_of_band, strict=True)
                }
        if tenants:
            by_tenant[envoy.node_id] = sums.add_tenants(tenants, reported)
        by_envoy[envoy.node_id] = demands
    return BandLoad(
        in_flight=sums.in_flight,
        completions_per_s=sums.completions,
        issued_per_s=sums.issued,
        by_envoy=by_envoy,
        lanes_by_envoy=by_lane,
        tenants_by_envoy=by_tenant,
    )


@dataclass
class _Sums:
    """A pool's load over the fleet, summed as the Envoys' reports are read."""

    in_flight: dict[Band, int]
    issued: dict[Band, float]
    completions: float = 0.0

    def add(self, band: Band, loads: list[ClusterReport]) -> EnvoyDemand:
        """Count one Envoy's `loads` of `band`'s clusters; their demand."""
        self.in_flight[band] += sum(load.in_progress for load in loads)
        self.issued[band] += sum(load.issued_per_s for load in loads)
        self.completions += sum(load.successful_per_s for load in loads)
        return _demand(loads)

    def add_tenants(
        self, tenants: Mapping[Band, Mapping[str, str]], reported: Mapping[str, ClusterReport]
    ) -> dict[Band, dict[str, EnvoyDemand]]:
        """Count one Envoy's loads of the weighted tenants' lanes (`tenants`: band, then
        tenant, to its cluster); each lane's demand."""
        return {
            band: {t: self.add(band, [reported[c]]) for t, c in lanes.items() if c in reported}
            for band, lanes in tenants.items()
        }


def _long_prompts(clusters: list[str], envoys: Iterable[EnvoyReport]) -> dict[str, int]:
    """From the Envoys that log long prompts, those still prefilling; from the others,
    those in flight as their last load report says (it cannot tell prefill from decode)."""
    total: dict[str, int] = {}
    for envoy in envoys:
        for cluster in clusters:
            if envoy.prefilling is not None:
                counts = envoy.prefilling.get(cluster, {})
            else:
                load = envoy.clusters.get(cluster)
                counts = load.by_endpoint if load is not None else {}
            for key, count in counts.items():
                total[key] = total.get(key, 0) + count
    return total
