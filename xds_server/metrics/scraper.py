"""Scraping every pod's `/metrics` page, on an interval, into a `MetricsStore`.

This is the slow loop's eyes (DESIGN.md, principle 2): the policy can only be as fresh as
the last scrape, so scraping must be cheap enough to run often (bench/scrape_cost.py
measures the CPU per scrape) and must never stall or crash on a bad pod.

- One task per pod, each on its own schedule: a random phase within the first interval,
  then every `interval_s` on absolute deadlines, so a thousand pods are spread over the
  interval instead of being fetched in lockstep, and a slow scrape does not shift the next.
  A pod has at most one scrape in flight; the next one waits.
- Pages are got through a `PageFetcher` (fetching.py): by default one kept-alive
  connection per pod with httptools' parser (keepalive.py), aiohttp for gzip and https;
  tests may pass their own. vLLM and SGLang are asked for only the series read
  (`ScrapeTarget.by_name`).
- A failed scrape (connect, timeout, HTTP status, broken body, a page over
  `max_page_bytes` or over the parser's caps, an unparseable page, a page not believed:
  the tree in `errors`) is recorded in the store, counted through `observe_error`, and
  never raised: the pod's last good metrics stay in use until the policy finds them too
  old (`silent_s`), and a pod with none is not in rotation. It is logged once per streak:
  the first failure at WARNING naming the pod, its URL and the error (for a page not
  believed: the value and the bound it broke); recovery at INFO; the failures in between
  at DEBUG. Only a bug of ours is an ERROR with a traceback. A failing pod is retried with
  exponential backoff from `interval_s` up to `max_backoff_s`, jittered. `_schedule` is
  the only place that decides when a pod is scraped next.
- Pages are distrusted input. Physical bounds are checked as a page is read (engines.py);
  what depends on the other pods (a KV cache far beyond its peers') is the `check` seam's,
  set by whoever knows the pools (sources/pod_metrics.py); a page it refuses is a failed
  scrape like any other.
- The page is parsed on the event loop: the fast parser reads a 59 KB vLLM page in ~0.1 ms,
  less than handing it to a thread would cost, and a page asked by name in ~0.01 ms. A
  whole scrape (request, page, parse, store) costs ~0.15 ms of CPU here
  (bench/scrape_cost.py): 2,000 busy pods at 0.25 s take 1.2 cores. A quiet pod (no
  queue, the same page as the last) is scraped every `quiet_interval_s` instead, so an
  idle fleet costs half that; what changes faster than the interval is Envoy's to
  handle, through its per-request least-request counting (DESIGN.md, principle 2).

- A pod that has given no page since it (re)started (new, or down since its last page)
  and whose page does not come in time is asked its health check (`ScrapeTarget.
  health_url`, the serving port's `/health`) after each such scrape: a restarted vLLM
  under load answered `/health` at once and `/metrics` only ~40 s later (issue 36). The
  store keeps the answer; policy/health.py gives such a pod a probation share. A page
  that answers with an error or is not believed gets no health check: the pod answered.

After each successful scrape, after each that could not connect at all (the pod is
down), and after each health answer, the optional, synchronous `on_update(pod_id)` runs
(the controller decides again there); callbacks that raise are logged once per streak
and do not stop scraping. `set_targets` may be called at any time, before or inside `async with`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Protocol

from yarl import URL

from xds_server.clock import Clock, loop_clock
from xds_server.errors import ConfigError, MetricsError, ScrapeErrorKind
from xds_server.metrics.engines import (
    CapacityUnit,
    EngineAdapter,
    EngineKind,
    Overrides,
    PodMetrics,
    engine_adapter,
)
from xds_server.metrics.fetching import HttpPageFetcher, PageFetcher
from xds_server.metrics.keepalive import KeepAliveFetcher
from xds_server.metrics.store import ErrorStreak, MetricsStore

__all__ = [
    "DEFAULT_MAX_PAGE_BYTES",
    "ErrorObserver",
    "PageCheck",
    "ScrapeObserver",
    "ScrapeTarget",
    "Scraper",
    "ScraperState",
    "UpdateCallback",
]

logger = logging.getLogger(__name__)

UpdateCallback = Callable[[str], None]
"""`on_update(pod_id)`: called after each successful scrape of the pod, and after each that
could not connect (the pod is down)."""
ErrorObserver = Callable[[str, ScrapeErrorKind], None]
"""`observe_error(pod_id, kind)`: called after each failed scrape."""
ScrapeObserver = Callable[[str, float], None]
"""`observe_scrape(pod_id, duration_s)`: called after each successful scrape with the time
it took (fetch and parse)."""


class PageCheck(Protocol):
    """`check(pod_id, metrics)`, on every page read, right before its metrics are stored:
    raises `ImplausibleMetricsError` if they are not to be believed (then they are not
    stored), returns if they are (then they are stored: the check may remember them)."""

    def __call__(self, pod_id: str, metrics: PodMetrics) -> None: ...


DEFAULT_MAX_PAGE_BYTES = 1 << 20
"""The default cap on one page's bytes (`balancing.max_metrics_page_bytes`)."""

_EMPTY_OVERRIDES: Overrides = MappingProxyType({})


# The most bytes of a health check's answer read (vLLM's is empty).
_MAX_HEALTH_BYTES = 64 << 10

# Engines whose /metrics is prometheus-client's exposition, which honours `name[]`.
_FILTERABLE = frozenset({EngineKind.VLLM, EngineKind.SGLANG})


@dataclass(frozen=True, kw_only=True)
class ScrapeTarget:
    """Where a pod's metrics page is and how to read it.

    `url` is the full page URL (`http://10.0.0.1:8000/metrics`); `engine` names the model
    server (see `engines.EngineKind`); `overrides` replace metric names per logical metric,
    `capacity_unit` and `tokens_per_block` say what its KV capacity series counts
    (`engines.engine_adapter`; None: the engine's own).
    With `by_name`, an engine that serves its page with prometheus-client (vLLM, SGLang)
    is asked for only the series the adapter reads (`?name[]=...`, prometheus-client's
    own filter): 3 KB instead of 60, a fraction of the CPU per scrape. A server that
    ignores the parameter sends its whole page, read as before. `health_url` (None: none)
    is asked while the pod's page is late and it has given none since it (re)started
    (module docstring); a 200 answer in time is a yes.
    Raises `ConfigError` at construction for a URL that is not http(s) with a host, an
    unknown engine, or a bad override. `adapter` (the engine's reader) and `parsed_url` are
    derived once, here, rather than on every scrape.
    """

    url: str
    engine: EngineKind | str = EngineKind.VLLM
    overrides: Overrides = field(default_factory=lambda: _EMPTY_OVERRIDES)
    by_name: bool = False
    capacity_unit: CapacityUnit | None = None
    tokens_per_block: int | None = None
    health_url: str | None = None
    adapter: EngineAdapter = field(init=False, repr=False, compare=False)
    parsed_url: URL = field(init=False, repr=False, compare=False)
    parsed_health_url: URL | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parsed = _http_url(self.url, "Metrics")
        health = None if self.health_url is None else _http_url(self.health_url, "Health")
        object.__setattr__(self, "parsed_health_url", health)
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))
        adapter = engine_adapter(
            self.engine,
            overrides=self.overrides,
            capacity_unit=self.capacity_unit,
            tokens_per_block=self.tokens_per_block,
        )
        if self.by_name and adapter.engine in _FILTERABLE:
            parsed = parsed.extend_query([("name[]", name) for name in sorted(adapter.families)])
        object.__setattr__(self, "parsed_url", parsed)
        object.__setattr__(self, "adapter", adapter)

    def __hash__(self) -> int:
        return hash((self.url, str(self.engine), self.by_name))


def _http_url(url: str, what: str) -> URL:
    """`url` parsed; `ConfigError` unless it is http(s) with a host."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{what} URL {url!r} is not a URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"{what} URL {url!r} must be http:// or https:// with a host.")
    return parsed


class ScraperState(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class Scraper:
    """Scrapes a changing set of pods into `store`, as an async context manager.

    `interval_s` is the time between scrapes of one pod; a quiet pod (nothing waiting, and
    a page that reads as the last one did) is scraped every
    `quiet_interval_s` instead (None: `interval_s`), back at `interval_s` from the first
    scrape that finds it queueing or changed. `timeout_s` the most one scrape may
    take (connect, request, whole body); both may be changed while open. `max_backoff_s`
    bounds the wait between retries of a failing pod (never less than `interval_s`).
    `max_page_bytes` caps the bytes read of one page (may be changed while open). `check`
    (may be set while open) is asked about every page read before it is stored
    (`PageCheck`). `fetcher` gets the pages (fetching.py); without one, an HTTP fetcher
    with `max_connections` simultaneous requests, and gzip if `compress`. `clock` gives
    the time of scrapes and of the store's `now` (the event loop's by default: the same
    clock the scraper sleeps on). `seed` fixes the jitter. `_iterations` ends each pod's
    loop after that many scrapes (tests only; see `join`).

    Mutable state: `state`, `interval_s`, `quiet_interval_s`, `timeout_s`,
    `max_page_bytes`, `check`,
    `_targets` and `_tasks` (pod id -> target, its task), `_stopping` (tasks of removed
    pods, cancelled, not yet finished), `_callback_failing` (callbacks whose failure was
    logged). Changed only on the event loop.
    """

    def __init__(
        self,
        store: MetricsStore,
        *,
        interval_s: float = 0.25,
        quiet_interval_s: float | None = None,
        timeout_s: float = 1.0,
        max_connections: int = 256,
        max_backoff_s: float = 2.0,
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        compress: bool = False,
        on_update: UpdateCallback | None = None,
        observe_error: ErrorObserver | None = None,
        observe_scrape: ScrapeObserver | None = None,
        clock: Clock = loop_clock,
        fetcher: PageFetcher | None = None,
        check: PageCheck | None = None,
        seed: int | None = None,
        _iterations: int | None = None,
    ) -> None:
        self.store = store
        self._interval_s = self._timeout_s = 1.0
        self._max_page_bytes = DEFAULT_MAX_PAGE_BYTES
        self.interval_s = interval_s
        self.quiet_interval_s = quiet_interval_s
        self.timeout_s = timeout_s
        self.max_page_bytes = max_page_bytes
        self.max_backoff_s = max_backoff_s
        self.check = check
        if fetcher is None:
            # aiohttp for gzip and TLS; plain pages on the lean keep-alive fetcher.
            aiohttp_fetcher = HttpPageFetcher(
                max_connections=max_connections,
                compress=compress,
                keepalive_s=max(30.0, 4 * interval_s),
            )
            fetcher = aiohttp_fetcher if compress else KeepAliveFetcher(tls=aiohttp_fetcher)
        self._fetcher: PageFetcher = fetcher
        self.state = ScraperState.UNOPENED
        self._on_update = on_update
        self._observe_error = observe_error
        self._observe_scrape = observe_scrape
        self._clock = clock
        self._rng = random.Random(seed)
        self._iterations = _iterations
        self._targets: dict[str, ScrapeTarget] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._callback_failing: set[tuple[str, str]] = set()

    def __repr__(self) -> str:
        return (
            f"<Scraper state={self.state.value} targets={len(self._targets)} "
            f"interval_s={self.interval_s}>"
        )

    @property
    def interval_s(self) -> float:
        """Seconds between scrapes of one pod; a new value applies from each pod's next one."""
        return self._interval_s

    @interval_s.setter
    def interval_s(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"interval_s must be positive, not {value}.")
        self._interval_s = value

    @property
    def timeout_s(self) -> float:
        """The most one scrape may take; a new value applies from the next scrape."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"timeout_s must be positive, not {value}.")
        self._timeout_s = value

    @property
    def max_page_bytes(self) -> int:
        """The most bytes of one page read; a new value applies from the next scrape."""
        return self._max_page_bytes

    @max_page_bytes.setter
    def max_page_bytes(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"max_page_bytes must be at least 1, not {value}.")
        self._max_page_bytes = value

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Scraper:
        if self.state is not ScraperState.UNOPENED:
            raise RuntimeError(
                f"Cannot open the scraper: it is {self.state.value}, and a scraper can be "
                "opened only once."
            )
        self.state = ScraperState.OPEN
        for pod_id in self._targets:
            self._start(pod_id)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every scrape and close the connections. Idempotent."""
        if self.state is ScraperState.CLOSED:
            return
        self.state = ScraperState.CLOSED
        tasks = [*self._tasks.values(), *self._stopping]
        for task in tasks:
            task.cancel()
        await asyncio.shield(self._cleanup(tasks))

    async def _cleanup(self, tasks: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._fetcher.aclose()

    async def join(self) -> None:
        """Wait until every pod's loop has ended: they end by themselves only with
        `_iterations` (tests)."""
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # -- targets -----------------------------------------------------------------------------

    @property
    def targets(self) -> Mapping[str, ScrapeTarget]:
        return MappingProxyType(dict(self._targets))

    def set_targets(self, targets: Mapping[str, ScrapeTarget]) -> None:
        """Scrape exactly `targets` (pod id -> target) from now on.

        New pods are scraped within one interval; removed pods stop at once and are
        forgotten by the store; a pod whose target changed (URL, engine or names) starts
        afresh, as a new pod would.
        """
        if self.state is ScraperState.CLOSED:
            raise RuntimeError("Cannot set targets: the scraper is closed.")
        for pod_id, old in list(self._targets.items()):
            new = targets.get(pod_id)
            if new is None or new != old:
                del self._targets[pod_id]
                self._stop(pod_id)
                self.store.forget(pod_id)
        for pod_id, target in targets.items():
            if pod_id not in self._targets:
                self._targets[pod_id] = target
                if self.state is ScraperState.OPEN:
                    self._start(pod_id)

    def _start(self, pod_id: str) -> None:
        task = asyncio.create_task(
            self._run(pod_id, self._targets[pod_id]), name=f"scrape-{pod_id}"
        )
        task.add_done_callback(self._task_done)
        self._tasks[pod_id] = task

    def _stop(self, pod_id: str) -> None:
        task = self._tasks.pop(pod_id, None)
        if task is not None and not task.done():
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        self._callback_failing = {key for key in self._callback_failing if key[0] != pod_id}

    def _task_done(self, task: asyncio.Task[None]) -> None:
        """A pod loop never raises (it records every error); if it did, say so loudly: that
        pod's metrics now only age."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error(
            "Scraping stopped for %s: its loop died. Its metrics will only go stale.",
            task.get_name().removeprefix("scrape-"),
            exc_info=task.exception(),
        )

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self, pod_id: str, target: ScrapeTarget) -> None:
        deadline = self._clock() + self._rng.uniform(0.0, self.interval_s)
        attempts = 0
        while True:
            await asyncio.sleep(max(0.0, deadline - self._clock()))
            streak, quiet = await self._scrape_and_record(pod_id, target)
            attempts += 1
            if self._iterations is not None and attempts >= self._iterations:
                return
            deadline = self._schedule(deadline, self._clock(), streak, quiet=quiet)

    def _schedule(
        self, deadline: float, now: float, streak: ErrorStreak | None, *, quiet: bool = False
    ) -> float:
        """When to scrape next, after a scrape due at `deadline` ended at `now`.

        Healthy: the next slot of the pod's own grid (missed slots are skipped, not
        bunched), `quiet_interval_s` apart for a quiet pod. Failing: exponential backoff
        from `interval_s`, doubling per failure up to `max_backoff_s`, with ±10% jitter so
        failing pods do not retry together.
        """
        if streak is None:
            step = self.interval_s
            if quiet and self.quiet_interval_s is not None:
                step = max(step, self.quiet_interval_s)
            deadline += step
            if deadline <= now:
                deadline += (now - deadline) // step * step
                deadline += step
            return deadline
        longest = max(self.max_backoff_s, self.interval_s)
        backoff = min(longest, self.interval_s * 2.0 ** min(streak.count - 1, 30))
        return now + backoff * self._rng.uniform(0.9, 1.1)

    async def _scrape_and_record(
        self, pod_id: str, target: ScrapeTarget
    ) -> tuple[ErrorStreak | None, bool]:
        """Scrape once and record the outcome; returns the error streak (None on success)
        and whether the pod is quiet (`quiet_interval_s`)."""
        started = self._clock()
        internal: BaseException | None = None
        try:
            metrics = await self._scrape(pod_id, target)
        except MetricsError as exc:
            kind, message = exc.kind, str(exc)
        except Exception as exc:  # a bug of ours: keep scraping, but loudly
            kind, message, internal = ScrapeErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}", exc
        else:
            finished = self._clock()
            revision = self.store.revision
            ended = self.store.record_success(pod_id, metrics, now=finished)
            quiet = metrics.waiting == 0 and self.store.revision == revision
            if ended is not None:
                logger.info(
                    "Scraping pod %s (%s) works again after %d failed attempts over %.1f s; "
                    "the last error was: %s",
                    pod_id,
                    target.url,
                    ended.count,
                    finished - ended.first_at,
                    ended.last_error,
                )
            if self._observe_scrape is not None:
                self._callback(pod_id, "observe_scrape", self._observe_scrape, finished - started)
            if self._on_update is not None:
                self._callback(pod_id, "on_update", self._on_update)
            return None, quiet
        late = kind is ScrapeErrorKind.TIMEOUT
        streak = self.store.record_error(
            pod_id, message, now=self._clock(), down=kind is ScrapeErrorKind.CONNECT, late=late
        )
        if self._observe_error is not None:
            self._callback(pod_id, "observe_error", self._observe_error, kind)
        if late and target.parsed_health_url is not None and self.store.awaits_page(pod_id):
            await self._check_health(pod_id, target.parsed_health_url)
        if streak.down and self._on_update is not None:
            # A pod that refuses or resets connections is gone: the policy takes it out of
            # rotation now, not once its metrics are stale.
            self._callback(pod_id, "on_update", self._on_update)
        if streak.count == 1:
            logger.log(
                logging.ERROR if internal is not None else logging.WARNING,
                "%s pod %s (%s): %s. %s; further failures are not logged until a scrape succeeds.",
                "Not believing the metrics page of"
                if kind is ScrapeErrorKind.IMPLAUSIBLE
                else "Cannot scrape",
                pod_id,
                target.url,
                message,
                "It is down: out of rotation until a scrape succeeds"
                if streak.down
                else "Its last good metrics stay in use until they go stale (none: out of "
                "rotation)",
                exc_info=internal,
            )
        else:
            logger.debug("Scrape of pod %s failed (%d in a row): %s", pod_id, streak.count, message)
        return streak, False

    async def _check_health(self, pod_id: str, url: URL) -> None:
        """Ask a pod whose page is late, and has given none since it (re)started, its
        health check, and record the answer (module docstring). The first answer since it
        (re)started is logged."""
        try:
            await self._fetcher.fetch(url, timeout_s=self._timeout_s, max_bytes=_MAX_HEALTH_BYTES)
        except MetricsError as exc:
            answered = False
            logger.debug("Health check of pod %s (%s) failed: %s", pod_id, url, exc)
        else:
            answered = True
        if self.store.record_health(pod_id, answered=answered, now=self._clock()):
            logger.info(
                "Pod %s answers its health check (%s) but has given no metrics page since it"
                " (re)started: on probation until one comes.",
                pod_id,
                url,
            )
        if answered and self._on_update is not None:
            self._callback(pod_id, "on_update", self._on_update)

    def _callback(
        self, pod_id: str, name: str, callback: Callable[..., None], *args: object
    ) -> None:
        """Run a caller's callback; a raising one is logged (once until it works again) and
        does not stop scraping."""
        key = (pod_id, name)
        try:
            callback(pod_id, *args)
        except Exception:
            if key not in self._callback_failing:
                self._callback_failing.add(key)
                logger.exception(
                    "The %s callback raised for pod %s; scraping goes on (logged once until "
                    "it succeeds again).",
                    name,
                    pod_id,
                )
        else:
            self._callback_failing.discard(key)

    async def _scrape(self, pod_id: str, target: ScrapeTarget) -> PodMetrics:
        """Fetch, read and check one page. Raises `ScrapeError` or `MetricsParseError`
        (`ImplausibleMetricsError` for a page not believed)."""
        if self.state is not ScraperState.OPEN:
            raise RuntimeError("The scraper is not open; use it inside `async with`.")
        body = await self._fetcher.fetch(
            target.parsed_url, timeout_s=self._timeout_s, max_bytes=self._max_page_bytes
        )
        metrics = target.adapter.parse(body.decode("utf-8", errors="replace"))
        if self.check is not None:
            self.check(pod_id, metrics)
        return metrics
