"""Kubernetes Events about the objects this server reads, where their owners look.

A bad ConfigMap never costs the last good config (DESIGN.md, principle 5), so a refusal
would otherwise show only in this server's log and metrics. An Event on the object puts
it where whoever wrote the object looks: `kubectl describe configmap ...` and
`kubectl get events`.

These are core/v1 Events (every cluster serves them, and `kubectl describe` reads them),
each a new object with `count` 1 and a unique name; the apiserver's Event TTL (an hour by
default) removes them. Nothing aggregates repeats here: record on a change (a new version
of the object), not on every pass.

Recording never raises: the server routes the same whether or not it may create Events
(RBAC), so a failure is logged (at WARNING once per streak) and counted, and that is all.
The POST runs in `asyncio.to_thread`, bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

import kubernetes.client

from xds_server.sources.kubernetes.client import kubernetes_error
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

__all__ = ["EventRecorder", "EventType", "event_for"]

logger = logging.getLogger(__name__)

EventType = Literal["Normal", "Warning"]

_MAX_MESSAGE = 1024  # what client-go's recorders keep of a message
_MAX_NAME = 253


def event_for(
    *,
    involved: Mapping[str, Any],
    reason: str,
    message: str,
    type: EventType,
    component: str,
    instance: str,
    now: datetime,
) -> dict[str, Any]:
    """The core/v1 Event (a JSON dict) saying `reason` and `message` about `involved`, an
    object as the API serves it (its apiVersion, kind, name, namespace, uid and
    resourceVersion are referenced; what it lacks is left out). The Event lives in the
    object's namespace ("default" for a cluster-scoped object)."""
    meta = involved.get("metadata") or {}
    name = str(meta.get("name") or "unnamed")
    namespace = str(meta.get("namespace") or "default")
    reference = {
        "apiVersion": involved.get("apiVersion"),
        "kind": involved.get("kind"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
    }
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 1] + "…"
    suffix = "." + secrets.token_hex(8)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name[: _MAX_NAME - len(suffix)] + suffix, "namespace": namespace},
        "involvedObject": {k: v for k, v in reference.items() if v},
        "reason": reason,
        "message": message,
        "type": type,
        "source": {"component": component, "host": instance},
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class EventRecorder:
    """Creates Events as `component` (the reporting component, "xds-server") from
    `instance` (the reporting instance: the host name, which in a pod is the pod's name).

    Mutable state: `_failing` (whether the current failure streak was logged).
    """

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        *,
        component: str = "xds-server",
        instance: str | None = None,
        telemetry: KubernetesTelemetry | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.component = component
        self.instance = instance or socket.gethostname()
        self.timeout_s = timeout_s
        # Any: the client's own annotations (where it has them) want a model, not a dict.
        self._core: Any = kubernetes.client.CoreV1Api(api_client)
        self._telemetry = telemetry
        self._failing = False

    async def record(
        self,
        *,
        involved: Mapping[str, Any],
        reason: str,
        message: str,
        type: EventType = "Warning",
    ) -> None:
        """Create an Event about `involved` (see `event_for`). Never raises: a failure is
        logged and counted."""
        event = event_for(
            involved=involved,
            reason=reason,
            message=message,
            type=type,
            component=self.component,
            instance=self.instance,
            now=datetime.now(UTC),
        )
        subject = event["involvedObject"]
        what = (
            f"Recording the {type} Event {reason!r} on {subject.get('kind', 'object')} "
            f"{event['metadata']['namespace']}/{subject.get('name', '?')}"
        )
        try:
            await asyncio.to_thread(self._create, event)
        except Exception as exc:
            error = kubernetes_error(exc, doing=what)
            if self._telemetry is not None:
                self._telemetry.observe_recorded(ok=False)
            if not self._failing:
                self._failing = True
                logger.warning(
                    "%s. The Event is dropped; routing is not affected (further failures are "
                    "logged at DEBUG until one succeeds).",
                    str(error).rstrip("."),
                )
            else:
                logger.debug("%s", error)
            return
        if self._telemetry is not None:
            self._telemetry.observe_recorded(ok=True)
        if self._failing:
            self._failing = False
            logger.info("Recording Kubernetes Events works again.")
        logger.debug("Recorded the %s Event %s: %s", type, event["metadata"]["name"], message)

    def _create(self, event: dict[str, Any]) -> None:
        response = self._core.create_namespaced_event(
            event["metadata"]["namespace"],
            event,
            _preload_content=False,
            _request_timeout=self.timeout_s,
        )
        try:
            response.read()
        finally:
            response.release_conn()
