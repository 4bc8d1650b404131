"""Every exception this package raises on purpose.

    XdsServerError
    ├── ConfigError                a routing document that cannot be used
    └── InconsistentSnapshotError  a snapshot that references resources it does not hold

Errors from grpc, aiohttp and yaml are translated into these at the boundary (`from exc`),
so callers handle one tree. Only `xds_server.xds.server` maps errors to gRPC status codes.
"""

from __future__ import annotations

__all__ = ["ConfigError", "InconsistentSnapshotError", "XdsServerError"]


class XdsServerError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(XdsServerError, ValueError):
    """A routing config that cannot be used; the message names the offending field."""


class InconsistentSnapshotError(XdsServerError):
    """A snapshot that references a resource it does not hold (it would leave Envoy warming)."""
