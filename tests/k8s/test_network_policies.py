"""The NetworkPolicies: who may reach which port of which pods, read with Kubernetes'
selector semantics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from tests.k8s.manifests import (
    NAMESPACE,
    Doc,
    _all,
    _bootstrap,
    _container,
    _envoy,
    _one,
    _pod_labels,
    _port_number,
    _routing_config,
    _selects,
    _server,
)
from xds_server.admin import default_debug_port
from xds_server.cli.parser import build_parser as _parser

# Where Prometheus runs: the namespace named `monitoring` (every namespace has this label
# with its name), or any namespace labelled PROMETHEUS_LABEL (k8s/server/ and
# k8s/envoy/networkpolicy.yaml).
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
PROMETHEUS_LABEL = {"xds-server.io/prometheus": "true"}


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


def _admitted(
    docs: list[Doc],
    *,
    to: Mapping[str, str],
    port: int,
    source: _Source,
    named: Mapping[str, int] | None = None,
) -> bool:
    """Whether the NetworkPolicies let `source` open a TCP connection to `port` of a pod
    with labels `to` in NAMESPACE, whose containers name their ports as `named`. A pod that
    no Ingress policy selects admits everything; one that some select admits what any of
    their rules allows (Kubernetes' semantics; a rule's port by name is the pod's port of
    that name)."""
    named = named or {}
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
                assert isinstance(entry["port"], int | str) and "endPort" not in entry, entry
            if ports is not None and not any(
                named.get(e["port"], e["port"]) == port and e.get("protocol", "TCP") == "TCP"
                for e in ports
            ):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, source) for peer in peers):
                return True
    return False


def _sources(docs: list[Doc]) -> dict[str, _Source]:
    """Who might connect: each Deployment's pods, Prometheus in the monitoring namespace or
    in a namespace labelled for it, a stray pod here, and a pod elsewhere that copies
    Envoy's labels."""
    here = _in_namespace(NAMESPACE)
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    return {
        "envoy": _Source(_pod_labels(_envoy(docs)), here),
        "xds-server": _Source(_pod_labels(_server(docs)), here),
        "model-server": _Source(_pod_labels(_one(docs, "Deployment", "vllm-llama")), here),
        "prometheus": _Source(prometheus, MONITORING),
        "prometheus in a labelled namespace": _Source(
            prometheus, {**_in_namespace("observability"), **PROMETHEUS_LABEL}
        ),
        "stray pod here": _Source({"run": "debug-shell"}, here),
        "envoy look-alike elsewhere": _Source(_pod_labels(_envoy(docs)), _in_namespace("team-a")),
    }


def _admitted_sources(docs: list[Doc], to: Doc, port: int) -> set[str]:
    named = {
        p["name"]: p["containerPort"]
        for c in to["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
        if "name" in p
    }
    return {
        name
        for name, source in _sources(docs).items()
        if _admitted(docs, to=_pod_labels(to), port=port, source=source, named=named)
    }


PROMETHEUS = {"prometheus", "prometheus in a labelled namespace"}


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
    assert _admitted_sources(rendered, server, args.admin_port) == PROMETHEUS
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
    """Clients reach Envoy's listener from wherever Service `envoy` is exposed, so its
    rule admits everyone; its stats listener admits Prometheus only, and nothing else is
    reachable (admin is on loopback). No policy restricts egress: the server must reach
    the API server (outside any pod selector), and everything needs DNS (k8s/README.md,
    "Network policies", says why)."""
    envoy = _envoy(rendered)
    listener = _routing_config(rendered).listener.port
    assert _admitted_sources(rendered, envoy, listener) == set(_sources(rendered))
    _, _, bootstrap = _bootstrap(rendered)
    stats = _port_number(_container(envoy), "stats")
    assert _admitted_sources(rendered, envoy, stats) == PROMETHEUS
    admin = bootstrap["admin"]["address"]["socket_address"]["port_value"]
    assert _admitted_sources(rendered, envoy, admin) == set()
    for policy in _all(rendered, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        assert "egress" not in policy["spec"]


def test_the_policy_check_reads_selectors_as_kubernetes_does() -> None:
    """The checks above would pass anything if the evaluator admitted too much."""
    here = _Source({"app": "a"}, _in_namespace(NAMESPACE))
    elsewhere = _Source({"app": "a"}, _in_namespace("other"))
    policy: Doc = {
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
    named = {"web": 80}
    policy["spec"]["ingress"][0]["ports"] = [{"port": "web", "protocol": "TCP"}]
    assert _admitted([policy], to=target, port=80, source=here, named=named)
    assert not _admitted([policy], to=target, port=81, source=here, named=named)
    assert not _admitted([policy], to=target, port=80, source=here, named={"web": 81})
    policy["spec"]["ingress"][0]["ports"] = [{"port": 80, "protocol": "TCP"}]
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
