"""Local infrastructure the demo and the tests share: a real Envoy process and small
OpenAI-compatible backends. This package does I/O; the pure layers never import it."""

from __future__ import annotations

from xds_testbed.backends import BACKEND_ID_HEADER, ExampleBackend, RecordedRequest
from xds_testbed.envoy_process import EnvoyError, EnvoyProcess, find_envoy

__all__ = [
    "BACKEND_ID_HEADER",
    "EnvoyError",
    "EnvoyProcess",
    "ExampleBackend",
    "RecordedRequest",
    "find_envoy",
]
