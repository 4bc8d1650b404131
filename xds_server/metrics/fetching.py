"""The scrape-fetch seam: getting one metrics page, over HTTP by default.

The scraper (scraper.py) decides when and what to scrape, and what a page means; a
`PageFetcher` only gets the bytes. Tests can hand the scraper a fetcher of their own
instead of patching aiohttp, and every aiohttp error is translated here, at the boundary,
into `ScrapeError`.

`HttpPageFetcher` (the scraper's for gzip and https; plain pages go to the leaner
keepalive.py) keeps one aiohttp `ClientSession` for every pod: keep-alive connections
(a scrape is one request on an open connection, no handshake), at most `max_connections`
at once, no cookies, no proxy from the environment, and no compression by default (gzip
cuts a 59 KB page to ~9 KB on the wire but costs the pod CPU to compress and us ~30% more
CPU per scrape to inflate; `compress` turns it on where bandwidth is what is short).

A page is read up to a byte cap (`balancing.max_metrics_page_bytes`, 1 MiB by default; a
vLLM page is ~60 KB) and no further: a page that says it is longer (Content-Length) is not
read at all, and one that turns out longer (chunked, or decompressed) is cut there and its
connection closed. Either way it is a ScrapeError of kind TOO_LARGE. Pages are distrusted
input: a pod serving megabytes on every scrape would otherwise cost this server a core.
"""

from __future__ import annotations

from typing import Protocol

import aiohttp
from yarl import URL

from xds_server.errors import ScrapeError, ScrapeErrorKind

__all__ = ["HttpPageFetcher", "PageFetcher"]

_ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"


class PageFetcher(Protocol):
    """Gets one page of at most `max_bytes` bytes. `fetch` raises ScrapeError (CONNECT,
    TIMEOUT, HTTP_STATUS, BODY, or TOO_LARGE past `max_bytes`) and nothing else on purpose;
    `aclose` releases its connections (idempotent)."""

    async def fetch(self, url: URL, *, timeout_s: float, max_bytes: int) -> bytes: ...

    async def aclose(self) -> None: ...


class HttpPageFetcher:
    """A PageFetcher over HTTP (aiohttp). Reading stops at `max_bytes` (TOO_LARGE).

    Mutable state: the session, opened on the first fetch (inside the event loop) and
    closed by `aclose`.
    """

    def __init__(
        self,
        *,
        max_connections: int = 256,
        compress: bool = False,
        keepalive_s: float = 30.0,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1.")
        self.max_connections = max_connections
        self.compress = compress
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("Cannot fetch: the fetcher is closed.")
        if self._session is None:
            headers = {"Accept": _ACCEPT}
            if not self.compress:
                headers["Accept-Encoding"] = "identity"
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, keepalive_timeout=self.keepalive_s
                ),
                headers=headers,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
            )
        return self._session

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: URL, *, timeout_s: float, max_bytes: int) -> bytes:
        session = self._open()
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with session.get(url, timeout=timeout) as response:
                if response.status != 200:
                    raise ScrapeError(
                        f"HTTP {response.status} {response.reason or ''}".rstrip(),
                        kind=ScrapeErrorKind.HTTP_STATUS,
                    )
                return await _read(response, max_bytes)
        except TimeoutError as exc:
            raise ScrapeError(
                f"no complete page within {timeout_s:g} s", kind=ScrapeErrorKind.TIMEOUT
            ) from exc
        except aiohttp.ClientConnectionError as exc:
            raise ScrapeError(_describe(exc), kind=ScrapeErrorKind.CONNECT) from exc
        except aiohttp.ClientResponseError as exc:  # an answer that is not HTTP
            raise ScrapeError(
                f"not a valid HTTP response: {_first_line(exc.message)}",
                kind=ScrapeErrorKind.BODY,
            ) from exc
        except aiohttp.ClientError as exc:  # the body broke off
            raise ScrapeError(_describe(exc), kind=ScrapeErrorKind.BODY) from exc


_: type[PageFetcher] = HttpPageFetcher


async def _read(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body, or TOO_LARGE as soon as it is known to be over `max_bytes` (then the
    connection is closed: what is left of the body is never read)."""
    length = response.content_length
    if length is not None and length > max_bytes:
        response.close()
        raise ScrapeError(
            f"the page is {length} bytes (Content-Length), over the {max_bytes}-byte cap",
            kind=ScrapeErrorKind.TOO_LARGE,
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > max_bytes:
            response.close()
            raise ScrapeError(
                f"the page is over the {max_bytes}-byte cap (cut after {size} bytes)",
                kind=ScrapeErrorKind.TOO_LARGE,
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _describe(exc: BaseException) -> str:
    """One line for a log message and the store: the exception's name and first line."""
    text = _first_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].rstrip(":")
