"""The server's RBAC: exactly the verbs its code uses, ConfigMaps by name, checked against
every request the server makes to an API server double when started with the
Deployment's arguments."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import NamedTuple

from tests.k8s.manifests import (
    NAMESPACE,
    Doc,
    _all,
    _one,
    _Pki,
    _pod_labels,
    _routing_configmap,
    _server,
    _server_args,
    _server_tls_settings,
)
from tests.sources.kubernetes.apiserver import ApiServerDouble, RecordedRequest
from xds_server.app import XdsApplication
from xds_server.settings import KubernetesSettings, ServerSettings, WatchSettings

# Every (API group, resource, verb) the server's code uses, and so the most the Role grants:
# list + watch through `ResourceWatcher` (sources/kubernetes/watch.py) and core/v1 Event
# creation (sources/kubernetes/events.py). Nothing is read with `get`, patched or deleted.
SERVER_API_USE = {
    ("", "pods", "list"), ("", "pods", "watch"),
    ("", "configmaps", "list"), ("", "configmaps", "watch"),
    ("", "events", "create"),
    ("inference.networking.k8s.io", "inferencepools", "list"),
    ("inference.networking.k8s.io", "inferencepools", "watch"),
    ("inference.networking.x-k8s.io", "inferenceobjectives", "list"),
    ("inference.networking.x-k8s.io", "inferenceobjectives", "watch"),
    ("inference.networking.x-k8s.io", "inferencemodelrewrites", "list"),
    ("inference.networking.x-k8s.io", "inferencemodelrewrites", "watch"),
}  # fmt: skip


def _grants(role: Doc) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rbac_allows_exactly_what_the_server_needs(rendered: list[Doc]) -> None:
    assert not _all(rendered, "ClusterRole") and not _all(rendered, "ClusterRoleBinding")
    role = _one(rendered, "Role")
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], rule
    assert _grants(role) == SERVER_API_USE

    # ConfigMaps only by name: the one the server is started with, and only it.
    configmap = _routing_configmap(rendered)["metadata"]["name"]
    for rule in role["rules"]:
        if "configmaps" in rule["resources"]:
            assert rule["resources"] == ["configmaps"], rule
            assert rule.get("resourceNames") == [configmap], rule
        else:
            assert "resourceNames" not in rule, rule  # pods and CRDs are found by label

    binding = _one(rendered, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    service_account = _server(rendered)["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": service_account, "namespace": NAMESPACE}
    ]
    _one(rendered, "ServiceAccount", service_account)


class _ApiRequest(NamedTuple):
    """A request as RBAC sees it (the apiserver's RequestInfo)."""

    verb: str
    group: str
    resource: str
    namespace: str | None
    name: str | None


_API_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)"
    r"(?:/namespaces/(?P<namespace>[^/]+))?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?$"
)


def _as_rbac_sees_it(request: RecordedRequest) -> _ApiRequest:
    match = _API_PATH.match(request.path)
    assert match is not None, f"not a resource request: {request.method} {request.path}"
    name = match["name"]
    if request.method == "GET":
        verb = "get" if name else ("watch" if request.is_watch else "list")
    else:
        verbs = {"POST": "create", "PUT": "update", "PATCH": "patch"}
        verb = verbs.get(request.method) or ("delete" if name else "deletecollection")
    if verb in ("list", "watch"):
        # A list or watch names one object by the field selector metadata.name=NAME, and
        # that is the name RBAC's resourceNames are matched against.
        for term in request.query.get("fieldSelector", "").split(","):
            key, _, value = term.partition("=")
            if key.strip() == "metadata.name":
                name = value.lstrip("=").strip()
    return _ApiRequest(
        verb, match["group"] or "", match["resource"], match["namespace"], name or None
    )


def _allows(role: Doc, request: _ApiRequest) -> bool:
    """Whether a rule of `role` (bound in NAMESPACE) allows `request` (RBAC's matching)."""
    if request.namespace != NAMESPACE:
        return False
    return any(
        request.group in rule["apiGroups"]
        and request.resource in rule["resources"]
        and request.verb in rule["verbs"]
        and ("resourceNames" not in rule or request.name in rule["resourceNames"])
        for rule in role["rules"]
    )


def test_rbac_name_matching_is_as_the_apiserver_does_it(rendered: list[Doc]) -> None:
    """The check below would pass anything if it misread requests: a ConfigMap list
    without the field selector, or for another name, is refused, as by the apiserver."""
    role = _one(rendered, "Role")
    path = f"/api/v1/namespaces/{NAMESPACE}/configmaps"

    def allowed(query: dict[str, str], method: str = "GET", tail: str = "") -> bool:
        return _allows(role, _as_rbac_sees_it(RecordedRequest(method, path + tail, query)))

    assert allowed({"fieldSelector": "metadata.name=xds-server-config"})
    assert allowed({"fieldSelector": "metadata.name=xds-server-config", "watch": "true"})
    assert not allowed({})
    assert not allowed({"watch": "true"})
    assert not allowed({"fieldSelector": "metadata.name=other"})
    assert not allowed({}, tail="/xds-server-config")  # a get: not used, not granted
    assert not allowed({}, method="POST")
    events = f"/api/v1/namespaces/{NAMESPACE}/events"
    assert _allows(role, _as_rbac_sees_it(RecordedRequest("POST", events, {})))
    elsewhere = "/api/v1/namespaces/other/events"
    assert not _allows(role, _as_rbac_sees_it(RecordedRequest("POST", elsewhere, {})))


def _api_pod(name: str, ip: str, labels: Mapping[str, str]) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": dict(labels)},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


async def test_the_server_makes_only_requests_the_role_allows_and_uses_all_of_it(
    rendered: list[Doc], pki: _Pki
) -> None:
    """The server, started with the Deployment's own arguments against the API server
    double, holding the rendered ConfigMap, the example model server's pods and its peer's
    pod: every request it makes is one the Role allows (ConfigMaps by name through the
    field selector), and every grant of the Role is used. Unused grants fail too. Its TLS
    files are certificates issued as the Certificates ask, in place of the Secret."""
    role = _one(rendered, "Role")
    server = _server(rendered)
    args = _server_args(rendered)
    configmap = _routing_configmap(rendered)
    async with ApiServerDouble(bookmark_interval_s=0.2) as api:
        api.put({"apiVersion": "v1", "kind": "ConfigMap", **configmap})
        api.put(_api_pod("xds-server-a", "127.0.0.21", _pod_labels(server)))
        api.put(_api_pod("xds-server-b", "127.0.0.22", _pod_labels(server)))
        model_server = _pod_labels(_one(rendered, "Deployment", "vllm-llama"))
        api.put(_api_pod("vllm-llama-0", "127.0.0.23", model_server))
        settings = ServerSettings(
            kubernetes=KubernetesSettings(
                namespace=NAMESPACE,
                watch_namespaces=tuple(args.watch_namespace or (NAMESPACE,)),
                configmap=args.configmap,
                api_host=api.url,
                watch=WatchSettings(backoff_s=(0.05, 0.1, 0.2)),
            ),
            xds_port=0,
            admin_port=0,
            replica="xds-server-a",
            peers_selector=args.peers_selector,
            tls=_server_tls_settings(rendered, cert_dir=pki.server.directory),
        )
        async with XdsApplication(settings) as app:
            await app.wait_ready(within_s=30)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                seen = {(r.group, r.resource, r.verb) for r in map(_as_rbac_sees_it, api.requests)}
                if seen >= SERVER_API_USE or loop.time() > deadline:
                    break
                await asyncio.sleep(0.05)
        requests = [_as_rbac_sees_it(r) for r in api.requests]
    refused = sorted({r for r in requests if not _allows(role, r)})
    assert not refused, f"requests the Role does not allow: {refused}"
    used = {(r.group, r.resource, r.verb) for r in requests}
    assert used == _grants(role), f"granted, never used: {sorted(_grants(role) - used)}"
