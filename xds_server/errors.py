"""Every exception this package raises on purpose, in one tree.

    XdsServerError
    ├── ConfigError                a routing document that cannot be used
    ├── ResourceBuildError         a config or decision the Envoy builders cannot turn into
    │                              resources Envoy would accept
    ├── InconsistentSnapshotError  a snapshot that references resources it does not hold
    ├── MetricsError               a pod's metrics could not be had (`kind` says which stage)
    │   ├── MetricsParseError      the page came, but cannot be read (a malformed line in a
    │   │   │                      family we need, or a required family missing)
    │   │   ├── PageTooLargeError  more samples or labels of the families we need than
    │   │   │                      anyone's page has: not read to the end
    │   │   └── ImplausibleMetricsError  read, but not believed: a value no pod can have
    │   │                          (NaN, negative, KV use above 1, a KV cache far beyond
    │   │                          its peers'), named with the bound it broke
    │   └── ScrapeError            the page did not come (connect, timeout, HTTP status, body,
    │                              or more bytes than the page cap)
    └── KubernetesError            a Kubernetes API call failed, or no client can be set up

Errors from grpc, aiohttp, yaml and the kubernetes client are translated into these at the
boundary where they happen (`from exc`), so callers handle one tree: the config sources
raise ConfigError, the scraper ScrapeError, the Kubernetes sources KubernetesError. Only
`xds_server.xds` maps errors to gRPC status codes. ConfigError, ResourceBuildError and
MetricsParseError are also ValueErrors: each says that a value was wrong.
"""

from __future__ import annotations

import enum

__all__ = [
    "ConfigError",
    "ImplausibleMetricsError",
    "InconsistentSnapshotError",
    "KubernetesError",
    "MetricsError",
    "MetricsParseError",
    "PageTooLargeError",
    "ResourceBuildError",
    "ScrapeError",
    "ScrapeErrorKind",
    "XdsServerError",
]


class XdsServerError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(XdsServerError, ValueError):
    """A routing config that cannot be used; the message names the offending field.

    `problems`: a document that fails validation has each of its problems here, as
    `path.to.field: message` (the message lists the first 20); otherwise empty.
    """

    def __init__(self, message: str, *, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class ResourceBuildError(XdsServerError, ValueError):
    """Resources Envoy would refuse (a reserved model name, a duplicate endpoint, a weight
    below 1, ...); the message names the offending value."""


class InconsistentSnapshotError(XdsServerError):
    """A snapshot that references a resource it does not hold (it would leave Envoy warming)."""


class ScrapeErrorKind(enum.StrEnum):
    """Why a scrape failed, coarse enough to be a metric label (bounded cardinality)."""

    CONNECT = "connect"  # refused, reset, unreachable, DNS
    TIMEOUT = "timeout"  # no complete page within the scrape timeout
    HTTP_STATUS = "http_status"  # an answer other than 200
    BODY = "body"  # the body broke off, or was not HTTP
    TOO_LARGE = "too_large"  # over the page's byte cap, or over the parser's sample caps
    PARSE = "parse"  # a page that is not valid exposition text, or lacks a required family
    IMPLAUSIBLE = "implausible"  # a value outside physical bounds, or far beyond the peers'
    INTERNAL = "internal"  # a bug on our side; logged with its traceback


class MetricsError(XdsServerError):
    """Base of the errors of metrics scraping; `kind` says which stage failed.

    Never raised out of the scraper: a pod whose page cannot be had keeps its last metrics
    until they go stale (DESIGN.md, principle 5).
    """

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


class PageTooLargeError(MetricsParseError):
    """A page with more samples, or more labels, of the families read than the parser
    takes (exposition.py): reading it would cost more than any real pod's page does."""

    kind = ScrapeErrorKind.TOO_LARGE


class ImplausibleMetricsError(MetricsParseError):
    """A page that was read but is not believed: `metric` (the sample name, and the
    logical metric) has `value`, which breaks `bound` (a phrase: "above the 100000 bound").
    The page counts as a failed scrape: it never becomes the pod's metrics."""

    kind = ScrapeErrorKind.IMPLAUSIBLE

    def __init__(self, metric: str, value: float, bound: str) -> None:
        super().__init__(f"{metric} is {value:g}, {bound}: not believed")
        self.metric = metric
        self.value = value
        self.bound = bound


class ScrapeError(MetricsError):
    """A metrics page that could not be fetched; `kind` is one of CONNECT, TIMEOUT,
    HTTP_STATUS, BODY or TOO_LARGE (the fetcher translates aiohttp's exceptions into it)."""

    def __init__(self, message: str, *, kind: ScrapeErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


class KubernetesError(XdsServerError):
    """A Kubernetes API call that failed, or an API client that cannot be set up.

    `status` is the HTTP status (or the `code` of an ERROR watch event's Status) when the
    API server answered, None when it could not be reached or nothing was asked of it;
    `reason` is the Status reason (`NotFound`, `Expired`, ...) when there was one.
    """

    def __init__(self, message: str, *, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
