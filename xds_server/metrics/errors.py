"""The errors of metrics scraping.

    XdsServerError                 (xds_server.errors)
    └── MetricsError               a pod's metrics could not be had
        ├── MetricsParseError      the page came, but cannot be read (a malformed line in a
        │                          family we need, or a required family missing)
        └── ScrapeError            the page did not come (connect, timeout, HTTP status, body)

The scraper translates aiohttp's exceptions into `ScrapeError` at the boundary (`from exc`),
so the scrape loop handles one tree. Neither is ever raised out of the scraper: a pod whose
page cannot be had keeps its last metrics until they go stale (DESIGN.md, principle 5).
"""

from __future__ import annotations

import enum

from xds_server.errors import XdsServerError

__all__ = ["MetricsError", "MetricsParseError", "ScrapeError", "ScrapeErrorKind"]


class ScrapeErrorKind(enum.StrEnum):
    """Why a scrape failed, coarse enough to be a metric label (bounded cardinality)."""

    CONNECT = "connect"  # refused, reset, unreachable, DNS
    TIMEOUT = "timeout"  # no complete page within the scrape timeout
    HTTP_STATUS = "http_status"  # an answer other than 200
    BODY = "body"  # the body broke off, was too large, or was not text
    PARSE = "parse"  # a page that is not valid exposition text, or lacks a required family
    INTERNAL = "internal"  # a bug on our side; logged with its traceback


class MetricsError(XdsServerError):
    """Base of the errors of metrics scraping; `kind` says which stage failed."""

    kind: ScrapeErrorKind = ScrapeErrorKind.INTERNAL


class MetricsParseError(MetricsError, ValueError):
    """A metrics page that cannot be read.

    `line` is the 1-based line of the page at fault, or None when the fault is the page as a
    whole (a required family absent: a partial page). `problem` is the message without the
    line number.
    """

    kind = ScrapeErrorKind.PARSE

    def __init__(self, problem: str, *, line: int | None = None) -> None:
        super().__init__(problem if line is None else f"line {line}: {problem}")
        self.problem = problem
        self.line = line


class ScrapeError(MetricsError):
    """A metrics page that could not be fetched; `kind` is one of CONNECT, TIMEOUT,
    HTTP_STATUS or BODY."""

    def __init__(self, message: str, *, kind: ScrapeErrorKind) -> None:
        super().__init__(message)
        self.kind = kind
