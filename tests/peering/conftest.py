"""The API server double's fixture, shared with tests/sources/kubernetes (imported, not copied)."""

from __future__ import annotations

from tests.sources.kubernetes.conftest import apiserver

__all__ = ["apiserver"]
