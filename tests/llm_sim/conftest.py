"""Fixtures shared by the simulator's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for the pods' HTTP endpoints."""
    async with aiohttp.ClientSession() as session:
        yield session
