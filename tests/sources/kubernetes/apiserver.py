"""A Kubernetes API server double that speaks the real list/watch wire protocol, on loopback.

No real API server can run here (no kind, no k3s, no Docker engine: DESIGN.md), so the
Kubernetes sources are tested with the official `kubernetes` client against this aiohttp
server instead. It is small, but it keeps the parts of the protocol a watcher depends on:

- one global, monotonically increasing `resourceVersion` (a string on the wire), stamped
  with `uid` and `creationTimestamp` on every object it stores, as etcd and the apiserver do;
- lists as `{"kind": "PodList", "metadata": {"resourceVersion": "N"}, "items": [...]}`;
  core items carry no kind/apiVersion (as the apiserver serves them), custom objects do;
- `labelSelector` (`a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`) and
  `fieldSelector` (`path=value`, `path!=value`, e.g. `metadata.name=x`);
- `?watch=true`: HTTP 200, chunked, one JSON event per line. From `resourceVersion=N` the
  changes after N are replayed from the history, then live ones follow; without one (or
  with "0") every matching object comes first as ADDED. A change that makes an object
  start or stop matching the selectors arrives as ADDED or DELETED, as from the apiserver.
  With `allowWatchBookmarks=true` a BOOKMARK (kind, apiVersion and
  metadata.resourceVersion only) comes every `bookmark_interval_s`. The stream ends
  cleanly after `timeoutSeconds`, on `expire_watches()` and on `stop()`;
- a watch from a resourceVersion older than the compacted history gets, like the real
  thing, HTTP 200 and one `ERROR` event carrying a 410 `Expired` Status, then the end; a
  list with `resourceVersionMatch=Exact` at such a version gets HTTP 410;
- a CRD group that is not installed answers 404 with a `NotFound` Status; a create of a
  plural in `forbidden_creates` answers 403 `Forbidden`, as without RBAC for it.

Not modelled: auth, PUT/PATCH, pagination (`limit` is ignored, which the API allows),
`sendInitialEvents`, and lists of past versions (`resourceVersionMatch=Exact` at a version
that is not compacted serves the current state).

The store outlives `stop()`, as etcd outlives an apiserver restart: `start()` again on the
same port and clients find the data, and the resourceVersions, where they left them. Every
method is synchronous and must be called on the event loop that runs the server (the
test's); call the blocking `kubernetes` client through `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, NamedTuple

import kubernetes.client
from aiohttp import web

__all__ = ["RESOURCES", "ApiServerDouble", "RecordedRequest", "Resource", "flag"]

Object = dict[str, Any]
Matcher = Callable[[Object], bool]


@dataclass(frozen=True)
class Resource:
    """A kind the double serves; all of them are namespaced."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


RESOURCES = (
    Resource("", "v1", "pods", "Pod"),
    Resource("", "v1", "configmaps", "ConfigMap"),
    Resource("", "v1", "events", "Event"),
    Resource("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool"),
    Resource(
        "inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives", "InferenceObjective"
    ),
    Resource(
        "inference.networking.x-k8s.io",
        "v1alpha2",
        "inferencemodelrewrites",
        "InferenceModelRewrite",
    ),
)


def flag(value: str | None) -> bool:
    """A boolean query parameter as the apiserver reads it (Go's strconv.ParseBool): older
    clients send `True`, newer ones `true`."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


class RecordedRequest(NamedTuple):
    method: str
    path: str
    query: dict[str, str]

    @property
    def is_watch(self) -> bool:
        return flag(self.query.get("watch"))


class _Change(NamedTuple):
    rv: int
    resource: Resource
    type: str  # ADDED, MODIFIED or DELETED
    obj: Object  # the state after it (DELETED: the last state, with the deletion's rv)
    old: Object | None  # the state before it (MODIFIED), to follow selector transitions


@dataclass(eq=False)
class _Watch:
    pending: collections.deque[_Change] = field(default_factory=collections.deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    expired: bool = False

    def push(self, change: _Change) -> None:
        self.pending.append(change)
        self.wakeup.set()

    def expire(self) -> None:
        self.expired = True
        self.wakeup.set()


_CORE_PATH = re.compile(r"^/api/(v1)(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?$")
_GROUP_PATH = re.compile(r"^/apis/([^/]+)/([^/]+)(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?$")
_LABEL_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[^\s!=,()]+)\s*"
    r"(?:(?P<op>==|=|!=|\s+in\s+|\s+notin\s+)\s*(?P<value>\([^)]*\)|[^\s,()]*)\s*)?$"
)


def _labels_match(selector: str, labels: Mapping[str, str]) -> bool:
    """Whether `labels` satisfy a label selector; raises ValueError for a malformed one."""
    for term in re.split(r",(?![^()]*\))", selector):
        if not term.strip():
            continue
        m = _LABEL_TERM.match(term)
        if m is None or (m["neg"] and m["op"]):
            raise ValueError(f"unable to parse requirement: {term!r}")
        key, op, value = m["key"], (m["op"] or "").strip(), m["value"]
        if not op:
            ok = key in labels
            ok = not ok if m["neg"] else ok
        elif op in ("=", "=="):
            ok = labels.get(key) == value
        elif op == "!=":
            ok = labels.get(key) != value
        else:
            values = {v.strip() for v in value.strip("()").split(",")}
            ok = (labels.get(key) in values) if op == "in" else (labels.get(key) not in values)
        if not ok:
            return False
    return True


def _fields_match(selector: str, obj: Object) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        path, op, value = re.split(r"(!=|==|=)", term, maxsplit=1)
        node: Any = obj
        for part in path.strip().split("."):
            node = node.get(part) if isinstance(node, dict) else None
        actual = "" if node is None else str(node)
        if (actual == value.strip()) != (op != "!="):
            return False
    return True


def _status(code: int, reason: str, message: str) -> Object:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": {},
        "code": code,
    }


def _error(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(_status(code, reason, message), status=code)


class ApiServerDouble:
    """The double, as an async context manager (`start` on enter, `stop` on exit).

    Mutable state: `_store` (resource -> (namespace, name) -> object), `_rv` (the latest
    resourceVersion), `_history` (changes after `_compacted_rv`), `_watches` (open watch
    streams), `installed_groups`, `forbidden_creates`, `requests`. Objects in the store are
    never mutated; each change stores a new one.
    """

    def __init__(self, *, port: int = 0, bookmark_interval_s: float = 1.0) -> None:
        self.port = port
        self.bookmark_interval_s = bookmark_interval_s
        # Groups whose CRDs are installed; remove one to make its paths answer 404.
        self.installed_groups: set[str] = {r.group for r in RESOURCES if r.group}
        # Plurals whose creation answers 403 Forbidden, as without RBAC to create them.
        self.forbidden_creates: set[str] = set()
        self.requests: list[RecordedRequest] = []
        self._store: dict[Resource, dict[tuple[str, str], Object]] = {r: {} for r in RESOURCES}
        self._rv = 1
        self._compacted_rv = 0
        self._history: list[_Change] = []
        self._watches: set[_Watch] = set()
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> ApiServerDouble:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def resource_version(self) -> int:
        return self._rv

    def configuration(self) -> kubernetes.client.Configuration:
        """A client configuration pointing at the double (plain HTTP, no auth)."""
        return kubernetes.client.Configuration(host=self.url)

    async def start(self) -> None:
        """Listen on 127.0.0.1, on `port` (the one bound before, after a `stop`)."""
        if self._runner is not None:
            raise RuntimeError("The API server double is already running.")
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        self.port = runner.addresses[0][1]
        self._runner = runner

    async def stop(self) -> None:
        """End every watch and stop listening; the store is kept for the next `start`."""
        runner, self._runner = self._runner, None
        if runner is not None:
            self.expire_watches()
            await runner.cleanup()

    # -- the store, for tests ----------------------------------------------------------------

    def put(self, obj: Mapping[str, Any]) -> Object:
        """Create or replace an object (by apiVersion, kind, namespace and name) and return
        it as stored. The namespace defaults to "default"; uid and creationTimestamp are kept
        across replacements."""
        resource = self._resource(obj["kind"], api_version=obj["apiVersion"])
        new = copy.deepcopy(dict(obj))
        meta = new.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        old = self._store[resource].get(key)
        old_meta = old["metadata"] if old is not None else {}
        meta["uid"] = old_meta.get("uid") or meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = (
            old_meta.get("creationTimestamp")
            or meta.get("creationTimestamp")
            or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        )
        self._commit(resource, key, new, old=old)
        return copy.deepcopy(new)

    def get(self, kind: str, namespace: str, name: str) -> Object | None:
        obj = self._store[self._resource(kind)].get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def delete(self, kind: str, namespace: str, name: str) -> Object:
        """Delete an object (KeyError if there is none); watchers get DELETED with its last
        state at a new resourceVersion."""
        resource = self._resource(kind)
        old = self._store[resource][(namespace, name)]
        gone = copy.deepcopy(old)
        self._commit(resource, (namespace, name), gone, old=old, deleted=True)
        return copy.deepcopy(gone)

    def objects(self, kind: str, namespace: str | None = None) -> list[Object]:
        return [
            copy.deepcopy(obj)
            for (ns, _), obj in sorted(self._store[self._resource(kind)].items())
            if namespace is None or ns == namespace
        ]

    def events(self, namespace: str | None = None) -> list[Object]:
        """The Events created (POSTed) so far, oldest first."""
        return sorted(
            self.objects("Event", namespace), key=lambda e: int(e["metadata"]["resourceVersion"])
        )

    def compact(self) -> None:
        """Forget the history up to now: watches from older versions get 410 from now on."""
        self._compacted_rv = self._rv
        self._history.clear()

    def expire_watches(self) -> None:
        """End every open watch stream now, cleanly, as a server-side timeout does."""
        for watch in self._watches:
            watch.expire()

    def _resource(self, kind: str, *, api_version: str | None = None) -> Resource:
        for resource in RESOURCES:
            if resource.kind == kind and api_version in (None, resource.api_version):
                return resource
        raise KeyError(f"The double does not serve {api_version or '?'} {kind}.")

    def _commit(
        self,
        resource: Resource,
        key: tuple[str, str],
        obj: Object,
        *,
        old: Object | None,
        deleted: bool = False,
    ) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if deleted:
            del self._store[resource][key]
            change = _Change(self._rv, resource, "DELETED", obj, None)
        else:
            self._store[resource][key] = obj
            change = _Change(self._rv, resource, "MODIFIED" if old else "ADDED", obj, old)
        self._history.append(change)
        for watch in self._watches:
            watch.push(change)

    # -- HTTP --------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(RecordedRequest(request.method, request.path, query))
        if m := _CORE_PATH.match(request.path):
            group, (version, namespace, plural, name) = "", m.groups()
        elif m := _GROUP_PATH.match(request.path):
            group, version, namespace, plural, name = m.groups()
        else:
            return _error(404, "NotFound", "the server could not find the requested resource")
        resource = next(
            (r for r in RESOURCES if (r.group, r.version, r.plural) == (group, version, plural)),
            None,
        )
        if resource is None or (group and group not in self.installed_groups):
            return _error(404, "NotFound", "the server could not find the requested resource")
        if request.method == "GET" and name is not None:
            obj = self._store[resource].get((namespace or "", name))
            if obj is None:
                return _error(404, "NotFound", f'{resource.plural} "{name}" not found')
            return web.json_response(obj)
        if request.method == "GET":
            try:
                matches = self._matcher(query)
            except ValueError as exc:
                return _error(400, "BadRequest", str(exc))
            if flag(query.get("watch")):
                return await self._watch(request, resource, namespace, matches, query)
            return self._list(resource, namespace, matches, query)
        if request.method == "POST" and name is None and namespace is not None:
            if resource.plural in self.forbidden_creates:
                message = (
                    f'{resource.plural} is forbidden: User "system:serviceaccount:{namespace}:'
                    f'xds-server" cannot create resource "{resource.plural}" in API group '
                    f'"{resource.group}" in the namespace "{namespace}"'
                )
                return _error(403, "Forbidden", message)
            return await self._create(request, resource, namespace)
        if request.method == "DELETE" and name is not None and namespace is not None:
            if (namespace, name) not in self._store[resource]:
                return _error(404, "NotFound", f'{resource.plural} "{name}" not found')
            return web.json_response(self.delete(resource.kind, namespace, name))
        return _error(405, "MethodNotAllowed", f"{request.method} is not supported here")

    def _matcher(self, query: Mapping[str, str]) -> Matcher:
        labels, fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
        _labels_match(labels, {})  # raises ValueError now for a malformed selector
        for term in filter(None, (t.strip() for t in fields.split(","))):
            if not re.search(r"!=|==|=", term):
                raise ValueError(f"invalid field selector: {term!r}")

        def matches(obj: Object) -> bool:
            meta = obj.get("metadata", {})
            return _labels_match(labels, meta.get("labels") or {}) and _fields_match(fields, obj)

        return matches

    def _selected(
        self, resource: Resource, namespace: str | None, matches: Matcher
    ) -> list[Object]:
        return [
            obj
            for (ns, _), obj in sorted(self._store[resource].items())
            if namespace in (None, ns) and matches(obj)
        ]

    def _list(
        self, resource: Resource, namespace: str | None, matches: Matcher, query: Mapping[str, str]
    ) -> web.Response:
        rv = query.get("resourceVersion", "")
        if query.get("resourceVersionMatch") == "Exact" and rv.isdigit():
            if int(rv) < self._compacted_rv:
                message = f"too old resource version: {rv} ({self._compacted_rv})"
                return _error(410, "Expired", message)
        items = self._selected(resource, namespace, matches)
        if not resource.group:  # the apiserver leaves kind/apiVersion off core list items
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items]
        return web.json_response(
            {
                "kind": f"{resource.kind}List",
                "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    async def _create(
        self, request: web.Request, resource: Resource, namespace: str
    ) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return _error(400, "BadRequest", f"the body is not JSON: {exc}")
        meta = body.get("metadata") or {}
        name = meta.get("name") or (
            f"{meta['generateName']}{uuid.uuid4().hex[:5]}" if meta.get("generateName") else None
        )
        if not name:
            return _error(422, "Invalid", "metadata.name: Required value: name is required")
        if meta.get("namespace", namespace) != namespace:
            return _error(400, "BadRequest", "the namespace of the object does not match")
        if (namespace, name) in self._store[resource]:
            return _error(409, "AlreadyExists", f'{resource.plural} "{name}" already exists')
        body = {**body, "apiVersion": resource.api_version, "kind": resource.kind}
        body["metadata"] = {**meta, "name": name, "namespace": namespace}
        return web.json_response(self.put(body), status=201)

    async def _watch(
        self,
        request: web.Request,
        resource: Resource,
        namespace: str | None,
        matches: Matcher,
        query: Mapping[str, str],
    ) -> web.StreamResponse:
        rv = query.get("resourceVersion", "")
        if rv not in ("", "0") and not rv.isdigit():
            return _error(400, "BadRequest", f"invalid resource version: {rv!r}")
        bookmarks = flag(query.get("allowWatchBookmarks"))
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()

        def render(change: _Change) -> Object | None:
            if change.resource != resource:
                return None
            if namespace is not None and change.obj["metadata"]["namespace"] != namespace:
                return None
            now, before = matches(change.obj), change.old is not None and matches(change.old)
            if change.type == "MODIFIED" and now != before:
                return {"type": "ADDED" if now else "DELETED", "object": change.obj}
            return {"type": change.type, "object": change.obj} if now else None

        # Everything up to `self._rv` comes from the backlog, everything after it through the
        # watch's queue: both are taken here, with no await in between.
        watch = _Watch()
        if rv in ("", "0"):
            backlog = [
                {"type": "ADDED", "object": o} for o in self._selected(resource, namespace, matches)
            ]
        elif int(rv) < self._compacted_rv:
            message = f"too old resource version: {rv} ({self._compacted_rv})"
            backlog = [{"type": "ERROR", "object": _status(410, "Expired", message)}]
            watch.expire()
        else:
            backlog = [e for c in self._history if c.rv > int(rv) if (e := render(c))]
        self._watches.add(watch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout is not None else float("inf")
        next_bookmark = loop.time() + self.bookmark_interval_s
        try:
            await response.prepare(request)
            for event in backlog:
                await response.write(json.dumps(event).encode() + b"\n")
            while not watch.expired:
                if watch.pending:
                    if event := render(watch.pending.popleft()):
                        await response.write(json.dumps(event).encode() + b"\n")
                    continue
                now = loop.time()
                if now >= deadline:
                    break
                if bookmarks and now >= next_bookmark:
                    meta = {"resourceVersion": str(self._rv)}
                    mark = {"kind": resource.kind, "apiVersion": resource.api_version}
                    event = {"type": "BOOKMARK", "object": {**mark, "metadata": meta}}
                    await response.write(json.dumps(event).encode() + b"\n")
                    next_bookmark = now + self.bookmark_interval_s
                    continue
                wake_at = min(deadline, next_bookmark if bookmarks else deadline)
                watch.wakeup.clear()
                try:
                    wait = None if wake_at == float("inf") else wake_at - now
                    await asyncio.wait_for(watch.wakeup.wait(), wait)
                except TimeoutError:
                    pass
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away
        finally:
            self._watches.discard(watch)
        return response
