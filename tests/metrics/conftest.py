"""The misbehaving metrics server the scraper's tests switch (tests/metrics/scraping.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.metrics.scraping import FakeMetricsServer


@pytest.fixture
async def server() -> AsyncIterator[FakeMetricsServer]:
    fake = FakeMetricsServer()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()
