"""Fixtures: a started API server double, and a real `kubernetes` client pointing at it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import kubernetes.client
import pytest

from tests.sources.kubernetes.apiserver import ApiServerDouble


@pytest.fixture
async def apiserver() -> AsyncIterator[ApiServerDouble]:
    """A running double; bookmarks every 0.2 s so tests need not wait for them."""
    async with ApiServerDouble(bookmark_interval_s=0.2) as api:
        yield api


@pytest.fixture
def kube_client(apiserver: ApiServerDouble) -> Iterator[kubernetes.client.ApiClient]:
    """The official client, configured for the double; call it through asyncio.to_thread."""
    client = kubernetes.client.ApiClient(apiserver.configuration())
    try:
        yield client
    finally:
        client.close()
