"""The server's Deployment: its security settings and image tag (the Dockerfile's user,
pyproject.toml's version), probes on the admin port and the debug views kept inside the
pod, the arguments it is started with (its peers' selector picking its own pods and no
others), the routing ConfigMap parsing as a routing config, its Service, and a rolling
update that keeps a ready replica."""

from __future__ import annotations

import re

from tests.k8s.manifests import (
    K8S,
    ROOT,
    Doc,
    _all,
    _bootstrap,
    _container,
    _flag_values,
    _one,
    _pod_labels,
    _port_number,
    _pyproject,
    _routing_config,
    _routing_configmap,
    _selects,
    _server,
)
from xds_server.admin import default_debug_port
from xds_server.cli.parser import build_parser as _parser


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
