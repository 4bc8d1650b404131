"""The Envoys' load, from Envoy's cluster names to the policy's pools, bands and pods.

The xDS edge (xds/load_reports.py, xds/access_logs.py) keeps what the Envoys report per
cluster name, as Envoy names them. This is the one place those names are translated
(envoy/names.py says what each cluster carries), so the policy reads load by pool, band
and endpoint id, and telemetry counts admissions the same way. Clusters the config does
not name are not read.
"""

from __future__ import annotations

from collections.abc import Sequence

from xds_server.config import BANDS, Band, RoutingConfig
from xds_server.envoy import names
from xds_server.policy.admission import BandLoad
from xds_server.policy.decision import FleetLoad, PoolLoad
from xds_server.telemetry.bands import BandTotals
from xds_server.xds.access_logs import PrefillingPrompts
from xds_server.xds.load_reports import LoadReports

__all__ = ["EnvoyLoad"]


class EnvoyLoad:
    """The controller's LoadSource (and telemetry's BandTotalsSource): what every
    connected Envoy reports over LRS, and the long prompts they log while those prefill
    (ALS).

    All Envoys count, whatever their node group: the pods' capacity is shared by all.
    """

    def __init__(self, reports: LoadReports, prompts: PrefillingPrompts) -> None:
        self._reports = reports
        self._prompts = prompts

    def fleet_load(self, config: RoutingConfig) -> FleetLoad:
        return FleetLoad(
            pools={
                pool.name: PoolLoad(
                    bands=self._band_load(names.band_clusters(config, pool))
                    if config.flow_control.enabled
                    else BandLoad(in_flight={}),
                    long_prompts=self._long_prompts(names.long_prompt_clusters(config, pool)),
                )
                for pool in config.pools
            },
            envoys=max(1, len(self._reports.nodes())),
        )

    def band_totals(self, config: RoutingConfig) -> dict[tuple[str, Band], BandTotals]:
        """Admitted and refused requests per (pool, band) of `config` with flow control."""
        totals = {}
        for pool in config.pools:
            clusters = names.band_clusters(config, pool)
            for band in BANDS:
                totals[(pool.name, band)] = BandTotals(
                    admitted=self._reports.admitted(clusters[band]),
                    refused=self._reports.refused(clusters[band]),
                )
        return totals

    def _band_load(self, clusters: dict[Band, list[str]]) -> BandLoad:
        """In-flight requests per band (summed over the band's clusters and every Envoy)
        and the completions per second of all of them together."""
        rates = {band: [self._reports.rates(c) for c in cs] for band, cs in clusters.items()}
        return BandLoad(
            in_flight={
                band: sum(self._reports.in_progress(c) for c in cs) for band, cs in clusters.items()
            },
            completions_per_s=sum(r.successful_per_s for rs in rates.values() for r in rs),
            issued_per_s={band: sum(r.issued_per_s for r in rs) for band, rs in rates.items()},
        )

    def _long_prompts(self, clusters: Sequence[str]) -> dict[str, int]:
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
