"""The latest word from every pod, how old it is, and how its scrapes have been failing.

The scraper writes here; the policy reads an immutable `snapshot(now)`. Four things are
kept per pod (a string id such as "10.0.0.1:8000"):

- the last `PodMetrics` and the monotonic time of the last successful scrape. A failed
  scrape does not erase them: the pod's last metrics stay in use, and `silent_s` (how long
  scrapes have been failing since them) lets the policy decide when they are too old to
  trust (DESIGN.md, principle 5), while `down` says the last scrape could not connect;
- the current error streak: how many scrapes in a row failed, since when, the first and
  the last message. The scraper logs once per streak, so it asks the store whether an error
  starts a streak and whether a success ends one;
- whether the engine makes progress: its cumulative tokens (prefilled and generated),
  and since when, while it ran requests, they have not moved (`stalled_s`);
- the prefix-cache hit rate. Engines export cumulative token counters (hits, queries), and
  a lifetime ratio says little about what the cache holds now, so the rate is the ratio of
  the counters' increases over an exponentially decaying window: each scrape adds its
  deltas to two sums that halve every `hit_rate_half_life_s`. As a ratio of sums it weighs
  each scrape by its traffic (a scrape with one short prompt does not swing it), and it
  copes with irregular scrape intervals. A counter that goes down means the engine
  restarted: its new value is the increase since then, as Prometheus's `rate()` counts it.
  With no new prompt tokens the rate stays at its last value; it is None until a second
  scrape has shown prompt tokens. The same window over the engine's prefilled requests
  (its time-to-first-token histogram's count; its finished requests where it has no such
  histogram) gives the prompt tokens its cache saved per request
  (`cached_tokens_per_request`: hits over requests), which says whether keeping keys on
  their pods pays. Prefilled, because hits are counted at the prefill: over finished
  requests, a young pod whose requests are long (scenario h's agents run 20 s and more)
  reads two or three times what it saves;
- whether the pod has given a page since it (re)started (a new pod, or one whose scrape
  could not connect since its last page: its process went away) and, while it has not,
  whether it answers its health check (`record_health`), since when: its probation
  (`probation_s`, policy/health.py).

Pure state, no I/O and no clock: every method takes `now` (monotonic seconds, the clock the
scraper uses), so tests drive time by hand. Not thread-safe; it lives on the event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from xds_server.metrics.engines import PodMetrics

__all__ = ["ErrorStreak", "MetricsStore", "PodObservation"]


@dataclass(frozen=True, kw_only=True)
class ErrorStreak:
    """Scrapes of one pod that failed in a row: `count` of them, from `first_at` to
    `last_at`. `down` says the last one could not connect at all (refused, reset,
    unreachable): the pod is gone, not merely slow."""

    count: int
    first_at: float
    first_error: str
    last_error: str
    last_at: float = 0.0
    down: bool = False


@dataclass(frozen=True, kw_only=True)
class PodObservation:
    """What the policy may know about one pod at one moment.

    `metrics` is the last successfully scraped value (None before the first success);
    `age_s` is the time since that scrape (None before it). `prefix_hit_rate` is 0..1 or
    None (see the module docstring). `errors_in_a_row` counts the failed scrapes since the
    last success, `failing_for_s` the time since the first of them (None when the last
    scrape succeeded), and `last_error` says why the last one failed.
    """

    metrics: PodMetrics | None
    age_s: float | None
    prefix_hit_rate: float | None
    errors_in_a_row: int
    failing_for_s: float | None
    last_error: str | None
    # From the last good metrics (or the first failure, before any) to the last failed
    # scrape; 0 when the last scrape succeeded. Unlike `age_s`, it grows only while
    # scrapes are tried and fail, so a stall of this server is not taken for a silent pod.
    silent_s: float = 0.0
    # The last scrape could not connect at all (ErrorStreak.down).
    down: bool = False
    # How long, by its scrapes, the engine has run requests without processing a token
    # (prefill or generation); 0 when it moved or ran nothing at the last scrape.
    stalled_s: float = 0.0
    # Prompt tokens the prefix cache saved per finished request, over the hit-rate window
    # (None until known, or when the engine exports no request counter).
    cached_tokens_per_request: float | None = None
    # A pod with no page since it (re)started whose last health check answered: from its
    # first answer to its last check (it grows only with checks, like `silent_s`). None
    # otherwise: a page came, the pod is down, or its health check did not answer.
    probation_s: float | None = None


class _Pod:
    """One pod's mutable record."""

    __slots__ = (
        "answered",
        "answered_since",
        "checked_at",
        "hits",
        "hits_window",
        "metrics",
        "paged",
        "progress",
        "progress_at",
        "queries",
        "queries_window",
        "rate",
        "rate_at",
        "requests",
        "requests_hits_window",
        "requests_prefilled",
        "requests_window",
        "saved_per_request",
        "scraped_at",
        "streak",
    )

    def __init__(self) -> None:
        self.metrics: PodMetrics | None = None
        self.scraped_at: float | None = None
        self.streak: ErrorStreak | None = None
        self.hits: float | None = None  # the counters at the last scrape
        self.queries: float | None = None
        self.rate_at = 0.0
        self.hits_window = 0.0  # decayed sums of the increases
        self.queries_window = 0.0
        self.rate: float | None = None
        self.requests: float | None = None  # requests at the last scrape
        self.requests_prefilled = False  # whether those were prefilled, else finished
        self.requests_window = 0.0
        self.requests_hits_window = 0.0  # the hits since the requests' baseline
        self.saved_per_request: float | None = None
        # The engine's tokens processed at the last scrape, and when they last moved (or
        # it ran nothing, or does not say).
        self.progress: float | None = None
        self.progress_at = 0.0
        # Whether a page came since the pod (re)started; while none has: whether its last
        # health check answered, its first answer's time and its last check's.
        self.paged = False
        self.answered = False
        self.answered_since: float | None = None
        self.checked_at = 0.0

    def restarted(self) -> None:
        """The pod's process went away (a scrape could not connect): a new one starts
        without a page and without a health answer."""
        self.paged = self.answered = False
        self.answered_since = None


class MetricsStore:
    """Per-pod metrics, freshness, error streaks and prefix-cache hit rates.

    Mutable state: `_pods` (pod id -> its record) and `revision`. Changed only by
    `record_success`, `record_error`, `record_health` and `forget`.

    `revision` grows whenever what a snapshot tells besides ages changes: a scrape that
    reads the same page as the last one leaves it as it is, so a reader (the controller)
    can tell "nothing new" from one integer, and an idle fleet costs it nothing.
    """

    def __init__(self, *, hit_rate_half_life_s: float = 10.0) -> None:
        if not hit_rate_half_life_s > 0:
            raise ValueError(f"hit_rate_half_life_s must be positive, not {hit_rate_half_life_s}.")
        self.hit_rate_half_life_s = hit_rate_half_life_s
        self._pods: dict[str, _Pod] = {}
        self.revision = 0

    def __repr__(self) -> str:
        failing = sum(1 for pod in self._pods.values() if pod.streak is not None)
        return f"<MetricsStore pods={len(self._pods)} failing={failing}>"

    def __contains__(self, pod_id: object) -> bool:
        return pod_id in self._pods

    def __len__(self) -> int:
        return len(self._pods)

    def record_success(self, pod_id: str, metrics: PodMetrics, *, now: float) -> ErrorStreak | None:
        """Store a successful scrape of `pod_id` taken at `now`.

        Returns the error streak this success ended (so the caller can log the recovery once),
        or None if the previous scrape succeeded too.
        """
        pod = self._pods.get(pod_id)
        if pod is None:
            pod = self._pods[pod_id] = _Pod()
        before = (pod.metrics, pod.rate, _stalled_s(pod))
        ended, pod.streak = pod.streak, None
        tokens = metrics.tokens_processed
        if tokens is None or metrics.running == 0 or tokens != pod.progress:
            pod.progress_at = now
        pod.progress = tokens
        pod.metrics = metrics
        pod.scraped_at = now
        pod.paged, pod.answered, pod.answered_since = True, False, None
        self._update_rate(pod, metrics, now)
        if ended is not None or before != (metrics, pod.rate, _stalled_s(pod)):
            self.revision += 1
        return ended

    def record_error(
        self, pod_id: str, message: str, *, now: float, down: bool = False, late: bool = False
    ) -> ErrorStreak:
        """Record a failed scrape of `pod_id` at `now`; the pod's last metrics stay. `down`:
        it could not connect at all; `late`: no page came in time (a timeout), so a health
        answer stands until the next check (`record_health`); any other failure (an error
        status, a page not believed) ends it: the pod answered, and not with a page.

        Returns the streak it belongs to: `count == 1` means it starts one (log it).
        """
        pod = self._pods.get(pod_id)
        if pod is None:
            pod = self._pods[pod_id] = _Pod()
        previous = pod.streak
        pod.streak = ErrorStreak(
            count=1 if previous is None else previous.count + 1,
            first_at=now if previous is None else previous.first_at,
            first_error=message if previous is None else previous.first_error,
            last_error=message,
            last_at=now,
            down=down,
        )
        if down:
            pod.restarted()
        elif not late:
            pod.answered = False
        self.revision += 1
        return pod.streak

    def awaits_page(self, pod_id: str) -> bool:
        """Whether `pod_id` has given no page since it (re)started, and is not down: the
        pod whose health check `record_health` keeps."""
        pod = self._pods.get(pod_id)
        return pod is not None and not pod.paged and not (pod.streak and pod.streak.down)

    def record_health(self, pod_id: str, *, answered: bool, now: float) -> bool:
        """Record a health check of a pod that awaits its page (`awaits_page`; of any
        other, ignored): `answered` says it answered 2xx in time. Returns True when this
        is its first answer since it (re)started: its probation starts."""
        if not self.awaits_page(pod_id):
            return False
        pod = self._pods[pod_id]
        pod.answered, pod.checked_at = answered, now
        first = answered and pod.answered_since is None
        if first:
            pod.answered_since = now
        self.revision += 1
        return first

    def forget(self, pod_id: str) -> None:
        """Drop everything known about `pod_id` (it is no longer a target). No-op if unknown."""
        if self._pods.pop(pod_id, None) is not None:
            self.revision += 1

    def observation(self, pod_id: str, *, now: float) -> PodObservation | None:
        """What is known about `pod_id` at `now`, or None if nothing was recorded for it."""
        pod = self._pods.get(pod_id)
        return None if pod is None else _observe(pod, now)

    def snapshot(self, now: float) -> Mapping[str, PodObservation]:
        """Every pod's observation at `now`, as an immutable mapping (a copy: later scrapes
        do not change it)."""
        # Over a copy (atomic under the GIL): /metrics reads this from a worker thread.
        pods = list(self._pods.items())
        return MappingProxyType({pod_id: _observe(pod, now) for pod_id, pod in pods})

    def _update_rate(self, pod: _Pod, metrics: PodMetrics, now: float) -> None:
        hits = metrics.prefix_cache_hits_tokens
        queries = metrics.prefix_cache_queries_tokens
        prefilled = metrics.requests_prefilled is not None
        requests = metrics.requests_prefilled if prefilled else metrics.requests_finished
        if hits is None or queries is None:
            pod.hits = pod.queries = pod.rate = pod.requests = pod.saved_per_request = None
            pod.hits_window = pod.queries_window = pod.requests_window = 0.0
            pod.requests_hits_window = 0.0
            return
        if pod.hits is not None and pod.queries is not None:
            if hits < pod.hits or queries < pod.queries:  # the engine restarted
                new_hits, new_queries = hits, queries
            else:
                new_hits, new_queries = hits - pod.hits, queries - pod.queries
            decay = 0.5 ** (max(0.0, now - pod.rate_at) / self.hit_rate_half_life_s)
            pod.hits_window = pod.hits_window * decay + new_hits
            pod.queries_window = pod.queries_window * decay + new_queries
            # Without new queries both sums only decay: the rate stands (recomputing it
            # would move its last bits, and an idle pod would look changed every scrape).
            if new_queries > 0 and pod.queries_window > 0:
                pod.rate = min(1.0, max(0.0, pod.hits_window / pod.queries_window))
            # Another counter than the last scrape's (a config naming it anew): a new baseline.
            same = prefilled == pod.requests_prefilled
            _update_saved(pod, requests if same else None, new_hits, decay)
        pod.hits, pod.queries, pod.requests, pod.rate_at = hits, queries, requests, now
        pod.requests_prefilled = prefilled


def _update_saved(pod: _Pod, requests: float | None, new_hits: float, decay: float) -> None:
    """The window's cached prompt tokens per request (module docstring), with this
    scrape's increase of the hits. The hits are summed again from the requests' baseline,
    so that hits whose requests were never counted do not count."""
    if requests is None or pod.requests is None:
        pod.requests_window = pod.requests_hits_window = 0.0
        pod.saved_per_request = None
        return
    new_requests = requests if requests < pod.requests else requests - pod.requests
    pod.requests_window = pod.requests_window * decay + new_requests
    pod.requests_hits_window = pod.requests_hits_window * decay + new_hits
    if new_requests > 0:
        pod.saved_per_request = pod.requests_hits_window / pod.requests_window


def _stalled_s(pod: _Pod) -> float:
    """From the scrape its engine's tokens last moved (while it ran requests) to the last
    scrape: like `silent_s`, it grows only with scrapes, not with this server's stalls."""
    if pod.scraped_at is None:
        return 0.0
    return max(0.0, pod.scraped_at - pod.progress_at)


def _observe(pod: _Pod, now: float) -> PodObservation:
    streak = pod.streak
    silent_s = 0.0
    if streak is not None:
        since = pod.scraped_at if pod.scraped_at is not None else streak.first_at
        silent_s = max(0.0, streak.last_at - since)
    return PodObservation(
        metrics=pod.metrics,
        age_s=None if pod.scraped_at is None else max(0.0, now - pod.scraped_at),
        prefix_hit_rate=pod.rate,
        cached_tokens_per_request=pod.saved_per_request,
        errors_in_a_row=0 if streak is None else streak.count,
        failing_for_s=None if streak is None else max(0.0, now - streak.first_at),
        last_error=None if streak is None else streak.last_error,
        silent_s=silent_s,
        down=streak is not None and streak.down,
        stalled_s=_stalled_s(pod),
        probation_s=_probation_s(pod),
    )


def _probation_s(pod: _Pod) -> float | None:
    """`PodObservation.probation_s` of the pod."""
    down = pod.streak is not None and pod.streak.down
    if pod.paged or down or not pod.answered or pod.answered_since is None:
        return None
    return max(0.0, pod.checked_at - pod.answered_since)
