"""Connecting to the Kubernetes API, calling it off the event loop, and the typed error
every Kubernetes source raises.

The official `kubernetes` client is synchronous (urllib3). Its asyncio siblings
(`kubernetes_asyncio`, or the `kubernetes.aio` package only the newest releases ship)
would be one more client to trust; the synchronous API is the same in every release this
project accepts (30 to 37, both ends tested), so the sources use it and keep it off the
event loop: short calls (an Event) in `asyncio.to_thread`, each list and watch a
`BlockingCall`, a daemon thread of its own that can be abandoned at once (its docstring
says why). Whatever the client raises (`ApiException`, urllib3's errors, a bad
kubeconfig) is translated here, at the boundary, into `KubernetesError`, whose `status`
keeps the one fact callers branch on: 404 (the kind is not served: a CRD not installed)
and 410 (a watch too old: list again).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from xds_server.errors import KubernetesError

__all__ = [
    "BlockingCall",
    "CallMarker",
    "SERVICE_ACCOUNT_NAMESPACE",
    "api_client",
    "kubernetes_error",
    "own_namespace",
]

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
"""Where a pod finds the namespace it runs in."""


def kubernetes_error(exc: BaseException, *, doing: str) -> KubernetesError:
    """`exc`, raised by the `kubernetes` client while `doing` something (a phrase such as
    "listing pods in namespace 'default'"), as a `KubernetesError` to raise `from exc`."""
    if isinstance(exc, KubernetesError):
        return exc
    if isinstance(exc, ApiException):
        status = exc.status if isinstance(exc.status, int) and exc.status else None
        reason, message = _status_of(exc.body)
        detail = message or str(exc.reason or "").strip() or "no details"
        return KubernetesError(
            f"{doing} failed with HTTP {status}: {detail}", status=status, reason=reason
        )
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        cause = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        return KubernetesError(f"{doing} failed: the API server could not be reached ({cause})")
    return KubernetesError(f"{doing} failed: {type(exc).__name__}: {exc}")


def _status_of(body: object) -> tuple[str | None, str | None]:
    """The reason and message of a Status body, if `body` is one."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    if not isinstance(body, str):
        return None, None
    try:
        status = json.loads(body)
    except ValueError:
        return None, body.strip()[:200] or None
    if not isinstance(status, dict):
        return None, None
    reason, message = status.get("reason"), status.get("message")
    return (str(reason) if reason else None), (str(message) if message else None)


def api_client(
    *, kubeconfig: Path | None = None, host: str | None = None
) -> kubernetes.client.ApiClient:
    """A client for the API server.

    With `host` (tests, `kubectl proxy`): that URL, without auth. Otherwise, inside a pod
    (`KUBERNETES_SERVICE_HOST` is set) and with no `kubeconfig`: the pod's service account.
    Otherwise the kubeconfig: `kubeconfig`, else `$KUBECONFIG`, else `~/.kube/config`, with
    its current context. urllib3's own retries are off: callers retry (the watchers, with
    backoff) or give up (Events). Raises `KubernetesError` naming what could not be read.
    """
    configuration = kubernetes.client.Configuration()
    if host is not None:
        configuration.host = host.rstrip("/")
        source = host
    elif kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        source = "the pod's service account"
        try:
            load_incluster: Callable[..., None] = kubernetes.config.load_incluster_config
            load_incluster(client_configuration=configuration)
        except (ConfigException, OSError) as exc:
            raise KubernetesError(
                f"Cannot use the in-cluster Kubernetes config (KUBERNETES_SERVICE_HOST is "
                f"set): {exc}"
            ) from exc
    else:
        path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        source = f"kubeconfig {path}"
        try:
            load_kube_config: Callable[..., None] = kubernetes.config.load_kube_config
            load_kube_config(
                config_file=None if kubeconfig is None else str(kubeconfig),
                client_configuration=configuration,
                persist_config=False,
            )
        except (ConfigException, OSError, ValueError, TypeError) as exc:
            raise KubernetesError(f"Cannot read the Kubernetes {source}: {exc}") from exc
    # urllib3 would retry a failed request three times at once, logging a WARNING each
    # time; the watch loop is the one place that retries, with backoff (STYLE.md rule 8).
    configuration.retries = False
    logger.info("Talking to the Kubernetes API at %s (from %s).", configuration.host, source)
    return kubernetes.client.ApiClient(configuration)


def own_namespace(*, path: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """The namespace this pod runs in, from its service account; "default" outside a pod."""
    try:
        namespace = path.read_text(encoding="utf-8").strip()
    except OSError:
        return "default"
    return namespace or "default"


class CallMarker(enum.Enum):
    """What a `BlockingCall` hands over besides documents."""

    OPENED = "opened"  # the response's headers are in (HTTP 2xx)
    END = "end"  # the body ended normally


class BlockingCall:
    """One blocking request in a daemon thread of its own, its answer handed to the loop:
    `OPENED` once the response is in, then the JSON documents (the whole body, or one per
    line when `stream`), then `END`; or, wherever it failed, the exception instead.

    `request` is a client call made with `_preload_content=False` (it returns the unread
    urllib3 response). Not `asyncio.to_thread`: a watch holds its thread for minutes, and
    the default executor (min(32, CPUs + 4) threads) is shared by the whole server; five
    watches on a 2-core machine would fill it. And a thread blocked in `recv()` cannot be
    cancelled, so `close()` shuts the response's socket down from the loop: the read
    returns at once and the thread ends.

    Mutable state: `_response` and `_closed`, shared with the thread under `_lock`.
    """

    def __init__(self, request: Callable[[], Any], *, stream: bool, name: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._lock = threading.Lock()
        self._response: Any = None
        self._closed = False
        thread = threading.Thread(target=self._run, args=(request, stream), name=name, daemon=True)
        thread.start()

    async def next(self) -> Any:
        """The next item; raises what the request raised."""
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Abandon the request: a read blocked in the thread returns at once, and nothing
        more is handed over. Idempotent."""
        with self._lock:
            self._closed = True
            response, self._response = self._response, None
        if response is not None:
            _shutdown(response)

    def _hand(self, item: Any) -> bool:
        if self._closed:
            return False
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _run(self, request: Callable[[], Any], stream: bool) -> None:
        response: Any = None
        try:
            response = request()
            with self._lock:
                if not self._closed:
                    self._response = response
            if self._closed:
                return
            self._hand(CallMarker.OPENED)
            if stream:
                for line in _lines(response):
                    if not self._hand(json.loads(line)):
                        return
            else:
                self._hand(json.loads(response.data))
            self._hand(CallMarker.END)
        except Exception as exc:  # handed to the loop, raised there
            self._hand(exc)
        finally:
            if response is not None:
                with self._lock:
                    self._response = None
                _release(response, reuse=not self._closed)


def _lines(response: Any) -> Iterator[bytes]:
    """The non-blank lines of a streamed body, as each arrives."""
    pending = b""
    for chunk in response.stream(amt=None, decode_content=True):
        pending += chunk
        if b"\n" in chunk:  # a large object comes in many chunks: split once it is whole
            *lines, pending = pending.split(b"\n")
            yield from (line for line in lines if line.strip())
    if pending.strip():
        yield pending


def _shutdown(response: Any) -> None:
    """Shut the socket under `response` down, from any thread: a blocked read returns."""
    try:
        shutdown = getattr(response, "shutdown", None)  # urllib3 >= 2.3
        if callable(shutdown):
            shutdown()
            return
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError, RuntimeError):
        pass  # already closed


def _release(response: Any, *, reuse: bool) -> None:
    """Give the connection back to the pool (after a complete body) or close it."""
    try:
        if not reuse:
            response.close()
        response.release_conn()
    except Exception:  # closing is best effort; the pool checks connections before use
        logger.debug("Closing a Kubernetes API response failed.", exc_info=True)
