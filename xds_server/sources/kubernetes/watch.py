"""The live set of one kind's objects, kept by list + watch (kopf's `infinite_watch`,
client-go's reflector).

The protocol (https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes):
a LIST returns the objects and the collection's resourceVersion; a WATCH from that version
streams every change after it, one JSON event per line, and ends when the server's timeout
(`timeoutSeconds`) is up. `ResourceWatcher.run` is the only loop that reconnects
(STYLE.md rule 8), and it reacts to each way a watch can end:

- the stream ends (the server's timeout): watch again from the last version, no list
  (after a pause along `backoff_s` if it ended within a second without an event, so a
  proxy that cuts watches short cannot make a busy loop);
- 410 Expired (an HTTP status, or an ERROR event whose Status has code 410): the version
  is older than the server's history, so list again (relist reason "expired"). The list
  replaces the objects wholesale: deletions missed in the gap drop out, nothing doubles;
- 404: the kind is not served (its CRD is not installed): the watcher is `absent`, holds
  no objects, and lists again every `absent_retry_s`;
- anything else (the server unreachable, a 5xx, a broken stream): logged once per
  streak, counted, then the next rung of `backoff_s` and a list (reason "error"): after an
  outage only a list cannot be stale. The streak, and the backoff, end when a watch is
  accepted (HTTP 200).

Bookmarks (`allowWatchBookmarks`) only move the version on: the global resourceVersion
moves with every kind, so a watcher of a quiet kind would otherwise hold a version that
compaction soon forgets, and its next reconnect would cost a full list.

Each list and each watch is a `client.BlockingCall`: a daemon thread of its own that hands
the JSON documents to the loop, and whose socket is shut down from the loop when `run` is
cancelled, so cancelling ends at once; `_request_timeout` bounds the rest (connecting, a
silent connection), so no thread blocks forever.

Objects are plain JSON dicts as the API serves them (camelCase keys), for pods, ConfigMaps
and custom objects alike: requests ask for the raw response (`_preload_content=False`) and
the JSON is decoded here. Core list items come without kind and apiVersion (the apiserver
leaves them off); they are filled in from the list, so every object carries both.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import kubernetes.client

from xds_server.errors import KubernetesError
from xds_server.settings import WatchSettings
from xds_server.sources.kubernetes.client import (
    BlockingCall,
    CallMarker,
    kubernetes_error,
)
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

__all__ = [
    "ChangeCallback",
    "ResourceKind",
    "ResourceWatcher",
    "WatchObserver",
    "watch_options",
]

logger = logging.getLogger(__name__)

ChangeCallback = Callable[[], None]
"""`on_change()`: the objects changed (once per list and per event; debounce on your side)."""

Object = Mapping[str, Any]

# Core kinds this watcher can list, by plural: the CoreV1Api method names' singular.
_CORE_SINGULAR = {
    "configmaps": "config_map",
    "endpoints": "endpoints",
    "events": "event",
    "pods": "pod",
    "secrets": "secret",
    "services": "service",
}
_CONNECT_TIMEOUT_S = 10.0
_LIST_READ_TIMEOUT_S = 60.0
# A watch sends at least a bookmark now and then and ends by itself after watch_timeout_s;
# a connection silent for longer than that plus this slack is dead.
_WATCH_READ_SLACK_S = 30.0
# A watch that ends sooner than this without an event is paused before the next (client-go's
# reflector treats such a "very short watch" as an error).
_QUICK_END_S = 1.0


class WatchObserver(Protocol):
    """What a watcher reports; `KubernetesTelemetry` turns it into Prometheus metrics."""

    def observe_event(self, resource: str, event_type: str) -> None: ...

    def observe_relist(self, resource: str, reason: str) -> None: ...

    def observe_error(self, resource: str) -> None: ...

    def observe_objects(self, resource: str, count: int) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ResourceKind:
    """One kind of object to watch: its API group ("" for core), version and plural, the
    namespace ("" for every namespace) and optional label and field selectors in the API's
    syntax (`app=vllm,tier!=cpu`, `metadata.name=routing`).

    Core kinds are limited to those in `_CORE_SINGULAR` (pods, configmaps, services,
    endpoints, events, secrets); raises `ValueError` for others.
    """

    group: str
    version: str
    plural: str
    namespace: str
    label_selector: str | None = None
    field_selector: str | None = None

    def __post_init__(self) -> None:
        if not self.group and (self.version != "v1" or self.plural not in _CORE_SINGULAR):
            raise ValueError(
                f"Cannot watch core {self.version} {self.plural!r}: the watcher knows the "
                f"core kinds {', '.join(sorted(_CORE_SINGULAR))} (all v1)."
            )

    @property
    def resource(self) -> str:
        """The plural, qualified by the group for custom resources (a metrics label)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def __str__(self) -> str:
        where = f"in namespace {self.namespace!r}" if self.namespace else "in every namespace"
        text = f"{self.resource} {where}"
        selectors = [s for s in (self.label_selector, self.field_selector) if s]
        return f"{text} (selected by {', '.join(selectors)})" if selectors else text

    def list_function(self, client: kubernetes.client.ApiClient) -> Callable[..., Any]:
        """The client's list call for this kind (its list-or-watch operation), with the
        path arguments bound; the query is passed as keywords."""
        if not self.group:
            core = kubernetes.client.CoreV1Api(client)
            singular = _CORE_SINGULAR[self.plural]
            if self.namespace:
                function: Callable[..., Any] = getattr(core, f"list_namespaced_{singular}")
                return functools.partial(function, self.namespace)
            return getattr(core, f"list_{singular}_for_all_namespaces")  # type: ignore[no-any-return]
        custom = kubernetes.client.CustomObjectsApi(client)
        if self.namespace:
            return functools.partial(
                custom.list_namespaced_custom_object,
                self.group,
                self.version,
                self.namespace,
                self.plural,
            )
        return functools.partial(
            custom.list_cluster_custom_object, self.group, self.version, self.plural
        )


class ResourceWatcher:
    """Keeps `objects`, the live set of one kind's objects, by list + watch (see the module
    docstring for how each kind of failure is met).

    `on_change()` runs on the event loop after each list and each ADDED, MODIFIED or
    DELETED event; a callback that raises is logged (once until it succeeds again) and does
    not stop the watch. `backoff_s` is the ladder of waits after consecutive failures (the
    last rung repeats), `watch_timeout_s` the server-side length of one watch stream,
    `absent_retry_s` the wait between lists of a kind that is not served. Give it a client
    from `client.api_client()`, which turns urllib3's own retries off: with them on, each
    failed attempt would be three, each logged at WARNING by urllib3.

    Mutable state: `_objects`, `_rv` (the version to watch from; None: list first),
    `synced`, `absent`, `_synced` and `_settled` (their events), `_failures` and
    `_callback_failing` (what was logged), `_running`. Changed only on the event loop, by
    `run`.
    """

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        kind: ResourceKind,
        *,
        on_change: ChangeCallback,
        telemetry: WatchObserver | None = None,
        backoff_s: tuple[float, ...] = (0.2, 0.5, 1, 2, 5, 10),
        watch_timeout_s: int = 300,
        absent_retry_s: float = 30.0,
    ) -> None:
        if not backoff_s or min(backoff_s) < 0:
            raise ValueError("backoff_s must have at least one rung, none negative.")
        if watch_timeout_s < 1 or absent_retry_s <= 0:
            raise ValueError("watch_timeout_s must be at least 1 and absent_retry_s positive.")
        self.kind = kind
        self.backoff_s = backoff_s
        self.watch_timeout_s = int(watch_timeout_s)
        self.absent_retry_s = absent_retry_s
        self.synced = False
        self.absent = False
        self._list = kind.list_function(api_client)
        self._on_change = on_change
        self._telemetry = telemetry
        self._objects: dict[str, Object] = {}
        self._rv: str | None = None
        self._synced = asyncio.Event()
        self._settled = asyncio.Event()  # synced, or known to be absent
        self._callback_failing = False
        self._failures = 0  # failed lists and watches in a row
        self._running = False

    def __repr__(self) -> str:
        state = "absent" if self.absent else "synced" if self.synced else "unsynced"
        return (
            f"<ResourceWatcher {self.kind} {state} objects={len(self._objects)} "
            f"resource_version={self._rv}>"
        )

    @property
    def objects(self) -> Mapping[str, Object]:
        """ "namespace/name" -> the object as served (a JSON dict, with kind and apiVersion).

        A read-only view of the current set; do not mutate the objects."""
        return MappingProxyType(self._objects)

    @property
    def resource_version(self) -> str | None:
        """The version the next watch starts from; None when the next step is a list."""
        return self._rv

    async def wait_synced(self, timeout_s: float, *, or_absent: bool = False) -> None:
        """Return once the first list has succeeded (or, with `or_absent`, once the kind
        is known not to be served); raises `TimeoutError` after `timeout_s`."""
        event = self._settled if or_absent else self._synced
        async with asyncio.timeout(timeout_s):
            await event.wait()

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, *, _iterations: int | None = None) -> None:
        """List and watch until cancelled; never raises otherwise (but `RuntimeError` if
        this watcher is already running). `_iterations` (tests only) returns after that
        many passes, each one watch stream or one failure."""
        if self._running:
            raise RuntimeError(f"The watcher of {self.kind} is already running.")
        self._running = True
        try:
            await self._run(_iterations)
        finally:
            self._running = False

    async def _run(self, iterations: int | None) -> None:
        reason = "initial"
        passes = quick_ends = 0
        while iterations is None or passes < iterations:
            passes += 1
            try:
                if self._rv is None:
                    await self._relist(reason)
                if await self._watch():
                    quick_ends = 0
                    continue
                # A stream that ends at once, empty, again and again (a proxy cutting
                # watches short) must not become a busy loop: pause, but keep the version.
                quick_ends += 1
                delay = self._rung(quick_ends)
                logger.debug(
                    "The watch of %s ended at once without an event; watching again in %g s.",
                    self.kind,
                    delay,
                )
                await asyncio.sleep(delay)
            except KubernetesError as exc:
                self._rv = None
                if exc.status == 410:
                    logger.info("Listing %s again: %s.", self.kind, exc)
                    reason = "expired"
                elif exc.status == 404:
                    reason = "initial"
                    self._failures = 0
                    self._become_absent(exc)
                    await asyncio.sleep(self.absent_retry_s)
                else:
                    reason = "error"
                    self._failures += 1
                    delay = self._rung(self._failures)
                    self._failed(exc, delay=delay)
                    await asyncio.sleep(delay)

    def _rung(self, attempt: int) -> float:
        """The wait before attempt `attempt` + 1: the ladder's rung, the last one repeating."""
        return self.backoff_s[min(attempt, len(self.backoff_s)) - 1]

    async def _relist(self, reason: str) -> None:
        if self._telemetry is not None:
            self._telemetry.observe_relist(self.kind.resource, reason)
        logger.debug("Listing %s (%s).", self.kind, reason)
        call = BlockingCall(
            functools.partial(
                self._list,
                **self._selectors(),
                _preload_content=False,
                _request_timeout=(_CONNECT_TIMEOUT_S, _LIST_READ_TIMEOUT_S),
            ),
            stream=False,
            name=f"list-{self.kind.resource}",
        )
        try:
            await call.next()  # OPENED
            document = await call.next()
        except Exception as exc:
            raise kubernetes_error(exc, doing=f"Listing {self.kind}") from exc
        finally:
            call.close()
        try:
            rv = str(document["metadata"]["resourceVersion"])
            items = document.get("items") or []
            kind = str(document.get("kind", "")).removesuffix("List")
            api_version = document.get("apiVersion") or self.kind.api_version
            objects: dict[str, Object] = {}
            for item in items:
                obj = {"apiVersion": api_version, "kind": kind, **item} if kind else dict(item)
                objects[_key(obj)] = obj
        except (KeyError, TypeError, AttributeError) as exc:
            raise KubernetesError(
                f"Listing {self.kind} failed: the answer is not a list ({exc!r})."
            ) from exc
        if self.absent:
            logger.info("The API server serves %s now; following it.", self.kind)
        self.absent = False
        self._objects = objects
        self._rv = rv
        self.synced = True
        self._synced.set()
        self._settled.set()
        logger.debug("Listed %d of %s at version %s.", len(objects), self.kind, rv)
        self._changed()

    async def _watch(self) -> bool:
        """One watch stream, from `_rv` until the server ends it; returns whether it was of
        use (it brought an event, bookmarks included, or lasted `_QUICK_END_S`). Raises
        `KubernetesError`."""
        rv = self._rv
        assert rv is not None
        loop = asyncio.get_running_loop()
        started, events = loop.time(), 0
        call = BlockingCall(
            functools.partial(
                self._list,
                **self._selectors(),
                watch=True,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s,
                _preload_content=False,
                _request_timeout=(
                    _CONNECT_TIMEOUT_S,
                    self.watch_timeout_s + _WATCH_READ_SLACK_S,
                ),
            ),
            stream=True,
            name=f"watch-{self.kind.resource}",
        )
        logger.debug("Watching %s from version %s.", self.kind, rv)
        try:
            while True:
                try:
                    item = await call.next()
                except Exception as exc:
                    raise kubernetes_error(exc, doing=f"Watching {self.kind}") from exc
                if item is CallMarker.OPENED:
                    self._watch_accepted()
                elif item is CallMarker.END:
                    logger.debug("The watch of %s ended; watching again.", self.kind)
                    return events > 0 or loop.time() - started >= _QUICK_END_S
                else:
                    events += 1
                    self._apply(item)
        finally:
            call.close()

    def _apply(self, event: Any) -> None:
        """One watch event, applied to `_objects` and `_rv`."""
        try:
            event_type, obj = str(event["type"]), event["object"]
            if event_type == "ERROR":
                raise _status_error(obj, kind=self.kind)
            rv = str(obj["metadata"]["resourceVersion"])
            if self._telemetry is not None:
                self._telemetry.observe_event(self.kind.resource, event_type)
            if event_type == "BOOKMARK":
                self._rv = rv
                return
            key = _key(obj)
        except (KeyError, TypeError) as exc:
            raise KubernetesError(
                f"Watching {self.kind} failed: a malformed event ({exc!r})."
            ) from exc
        if event_type in ("ADDED", "MODIFIED"):
            self._objects[key] = obj
        elif event_type == "DELETED":
            self._objects.pop(key, None)
        else:
            raise KubernetesError(f"Watching {self.kind} failed: an event of type {event_type!r}.")
        self._rv = rv
        self._changed()

    def _selectors(self) -> dict[str, str]:
        selectors = {}
        if self.kind.label_selector:
            selectors["label_selector"] = self.kind.label_selector
        if self.kind.field_selector:
            selectors["field_selector"] = self.kind.field_selector
        return selectors

    def _become_absent(self, exc: KubernetesError) -> None:
        if not self.absent:
            logger.info(
                "The API server does not serve %s (is its CRD installed?): %s. Treating it as "
                "having no objects and asking again every %g s.",
                self.kind,
                exc,
                self.absent_retry_s,
            )
        self.absent = True
        self.synced = False
        self._synced.clear()
        self._settled.set()
        if self._objects:
            self._objects = {}
            self._changed()
        elif self._telemetry is not None:
            self._telemetry.observe_objects(self.kind.resource, 0)

    def _watch_accepted(self) -> None:
        """A watch was accepted: the end of a failure streak, if there was one."""
        if self._failures:
            logger.info(
                "Watching %s works again after %d failed attempts.", self.kind, self._failures
            )
            self._failures = 0

    def _failed(self, exc: KubernetesError, *, delay: float) -> None:
        if self._telemetry is not None:
            self._telemetry.observe_error(self.kind.resource)
        failures = self._failures
        if failures == 1:
            logger.warning(
                "%s. Keeping the objects last known (%d), retrying in %g s and backing off up "
                "to %g s; further failures are logged at DEBUG until it works again.",
                str(exc).rstrip("."),
                len(self._objects),
                delay,
                max(self.backoff_s),
            )
        else:
            logger.debug("%s (%d in a row; next try in %g s).", exc, failures, delay)

    def _changed(self) -> None:
        if self._telemetry is not None:
            self._telemetry.observe_objects(self.kind.resource, len(self._objects))
        try:
            self._on_change()
        except Exception:
            if not self._callback_failing:
                self._callback_failing = True
                logger.exception(
                    "The on_change callback for %s raised; watching goes on (logged once "
                    "until it succeeds again).",
                    self.kind,
                )
        else:
            self._callback_failing = False


def _key(obj: Object) -> str:
    meta = obj["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    return f"{namespace}/{name}" if namespace else str(name)


def _status_error(status: Any, *, kind: ResourceKind) -> KubernetesError:
    """The KubernetesError an ERROR watch event's Status stands for."""
    code = status.get("code") if isinstance(status, Mapping) else None
    reason = status.get("reason") if isinstance(status, Mapping) else None
    message = status.get("message") if isinstance(status, Mapping) else None
    return KubernetesError(
        f"The watch of {kind} ended with an error {code} {reason}: {message or status!r}",
        status=code if isinstance(code, int) else None,
        reason=str(reason) if reason else None,
    )


if TYPE_CHECKING:  # KubernetesTelemetry is what watchers report to (checked by mypy)

    def _conforms(telemetry: KubernetesTelemetry) -> WatchObserver:
        return telemetry


def watch_options(settings: WatchSettings) -> dict[str, Any]:
    """`settings` as ResourceWatcher's keyword arguments."""
    return {
        "backoff_s": settings.backoff_s,
        "watch_timeout_s": settings.watch_timeout_s,
        "absent_retry_s": settings.absent_retry_s,
    }
