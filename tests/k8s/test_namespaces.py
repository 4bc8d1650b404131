"""The manifests in any namespace: an overlay's `namespace:` moves every object, and nothing
else has to change with it. Envoy dials the server by the Service's short name, which the
pod's DNS search path resolves in its own namespace (shown here with a real Envoy, whose
resolver reads the search domains of /etc/resolv.conf), and the TLS names and identities
on both sides name no namespace either."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.k8s.cluster_dns import cluster_dns
from tests.k8s.manifests import (
    COMPONENTS,
    NAMESPACE,
    Doc,
    _all,
    _bootstrap,
    _certificate_for,
    _kustomize_overlay,
    _one,
    _Pki,
    _pod_envoy,
    _server_args,
    _server_tls_secret,
    _xds_endpoint,
    _xds_tls_context,
)
from xds_testbed.envoy_process import find_envoy

OTHER = "team-a"


def _in_default_namespace(doc: Doc, namespace: str) -> Doc:
    """`doc` as the default rendering has it: the fields kustomize's namespace transformer
    sets (the object's namespace, its RoleBinding subjects') put back."""
    doc = copy.deepcopy(doc)
    metadata = doc["metadata"]
    if doc["kind"] == "Namespace":
        assert metadata["name"] == namespace
        metadata["name"] = NAMESPACE
    else:
        assert metadata["namespace"] == namespace, metadata["name"]
        metadata["namespace"] = NAMESPACE
    for subject in doc.get("subjects", []):
        assert subject["namespace"] == namespace, subject
        subject["namespace"] = NAMESPACE
    return doc


def _key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def test_another_namespace_changes_the_namespace_and_nothing_else(rendered: list[Doc]) -> None:
    """Every component, rendered with `namespace: team-a`: each object is in team-a (the
    Namespace object is team-a, the RoleBinding binds team-a's service account), and with
    those put back, the rendering is the default one, field for field: the same bootstrap
    (so the same ConfigMap hash), Certificates and server arguments. The namespace
    transformer moves nothing else, so nothing else may name the namespace."""
    moved = _kustomize_overlay(COMPONENTS, namespace=OTHER)
    back = sorted((_in_default_namespace(d, OTHER) for d in moved), key=_key)
    assert back == sorted(rendered, key=_key)


def test_the_names_tls_checks_hold_in_another_namespace() -> None:
    """In team-a: Envoy dials the Service by its short name, sends it as SNI and requires it
    of the server's certificate, which carries it; the server requires of Envoy's
    certificate the identity it carries, and of its peers its own. None names a namespace."""
    moved = _kustomize_overlay(COMPONENTS, namespace=OTHER)
    _, _, bootstrap = _bootstrap(moved)
    service = _one(moved, "Service", "xds-server")
    assert service["metadata"]["namespace"] == OTHER
    context = _xds_tls_context(bootstrap)
    assert _xds_endpoint(bootstrap)["address"] == context["sni"] == service["metadata"]["name"]
    server = _certificate_for(moved, _server_tls_secret(moved)[0])["spec"]
    assert context["sni"] in server["dnsNames"]
    args = _server_args(moved)
    assert args.peer_server_name in server["dnsNames"]
    assert args.peer_identity in server["uris"]
    identities = [uri for c in _all(moved, "Certificate") for uri in c["spec"].get("uris", [])]
    assert identities.count(args.envoy_identity) == 1
    for name in (*server["dnsNames"], *server["uris"], args.envoy_identity, args.peer_identity):
        assert NAMESPACE + "." not in name and f"/ns/{NAMESPACE}" not in name, name


def _resolving_in(namespace: str, *, dns_port: int, root: Path) -> str:
    """An Envoy binary that sees, in a mount namespace of its own, the /etc/resolv.conf of
    a pod in `namespace`: its search domains, ndots 5, and cluster DNS (here the stand-in
    on 127.0.0.1:`dns_port`). Needs root (unshare), as CI runs."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.fail("this test needs root and unshare(1) (util-linux) for a mount namespace")
    resolv = root / "resolv.conf"
    resolv.write_text(
        f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local\n"
        f"nameserver 127.0.0.1:{dns_port}\noptions ndots:5\n"
    )
    wrapper = root / "envoy-in-pod"
    wrapper.write_text(
        "#!/bin/sh\n"
        "exec unshare --mount --propagation private /bin/sh -c '"
        f"mount --bind {resolv} /etc/resolv.conf && "
        f'exec {find_envoy()} "$@"\' envoy "$@"\n'
    )
    wrapper.chmod(0o755)
    probe = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, timeout=30)
    assert probe.returncode == 0, f"cannot run Envoy in a mount namespace: {probe.stderr}"
    return str(wrapper)


async def test_envoy_finds_the_server_by_its_short_name_in_the_pods_namespace(
    rendered: list[Doc], pki: _Pki, tmp_path: Path
) -> None:
    """A real Envoy with the committed bootstrap, unchanged but for the server's port and
    the files' places, resolving as a pod of team-a does: it asks cluster DNS for
    xds-server.team-a.svc.cluster.local (its first search domain) and gets the server, whose
    certificate (issued as the Certificate says) passes the name check; a request goes
    through."""
    service = f"xds-server.{OTHER}.svc.cluster.local"
    async with cluster_dns([service]) as (dns, dns_port):
        in_pod = _resolving_in(OTHER, dns_port=dns_port, root=tmp_path)
        async with _pod_envoy(rendered, pki, tmp_path, envoy_path=in_pod) as envoy:
            stats = await envoy.get_stats("cluster.xds_cluster.ssl.handshake")
            assert stats["cluster.xds_cluster.ssl.handshake"] >= 1
    assert dns.asked[0] == service, dns.asked
