"""Flow control in the routes (routes.py's docstring, "Flow control"): each route to a pool
becomes a group of classification routes, one per band a request can be given, each
carrying the band's metadata for the 429 of a full band.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any as _Any

from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.type.matcher.v3 import string_pb2

from xds_server.config import BANDS, Band, ModelBands, RoutingConfig
from xds_server.envoy import names
from xds_server.envoy._route_matches import with_header
from xds_server.policy.admission import PoolAdmission

__all__ = ["RetryAfter", "add_band", "classified", "retry_after_of"]


def retry_after_of(admissions: Mapping[str, PoolAdmission]) -> dict[tuple[str, Band], int]:
    """The Retry-After seconds of each (pool, band) as the admissions decided them, in the
    shape `build_routes` takes."""
    return {
        (pool, band): admission.retry_after_s[band]
        for pool, admission in admissions.items()
        for band in BANDS
    }


class RetryAfter:
    """The Retry-After seconds of a (pool, band), within the config's bounds."""

    def __init__(self, config: RoutingConfig, given: Mapping[tuple[str, Band], int]) -> None:
        self._low = config.flow_control.retry_after_min_s
        self._high = config.flow_control.retry_after_max_s
        self._given = given

    def of(self, pool: str, band: Band) -> int:
        return min(max(self._given.get((pool, band), self._low), self._low), self._high)


def _cap(band: Band, max_band: Band) -> Band:
    """`band`, or `max_band` when that is less important (BANDS: most important first)."""
    return BANDS[max(BANDS.index(band), BANDS.index(max_band))]


def classified(config: RoutingConfig, model: str, match: _Any) -> Iterator[tuple[str, Band, _Any]]:
    """(route name suffix, band, match) for each classification route of `model`'s `match`,
    in first-match order (routes.py's docstring: a, b, c)."""
    flow = config.flow_control
    bands = flow.models.get(model, ModelBands())
    default = _cap(bands.default_band, bands.max_band)
    for objective, priority in sorted(flow.objectives.items()):
        band = _cap(flow.band_of_priority(priority), bands.max_band)
        exact = string_pb2.StringMatcher(exact=objective)
        by_objective = rc_pb2.HeaderMatcher(name=names.OBJECTIVE_HEADER, string_match=exact)
        yield f"/{band}/objective/{objective}", band, with_header(match, by_objective)
    for asked in BANDS:
        band = _cap(asked, bands.max_band)
        if band != default:
            value = string_pb2.StringMatcher(exact=asked, ignore_case=True)
            by_band = rc_pb2.HeaderMatcher(name=flow.band_header, string_match=value)
            yield f"/{band}/band/{asked}", band, with_header(match, by_band)
    yield f"/{default}", default, match


def add_band(route: _Any, band: Band, pool: str, retry_after_s: int) -> None:
    """Add `band`, `pool` and `retry_after_s` to `route`'s metadata `llm`, printed by the
    429 of a full band and by the access log; the keys already there stay."""
    values = route.metadata.filter_metadata[names.METADATA_NAMESPACE]
    values[names.BAND_KEY] = band
    values[names.POOL_KEY] = pool
    values[names.RETRY_AFTER_KEY] = retry_after_s
