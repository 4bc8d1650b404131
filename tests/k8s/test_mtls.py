"""Mutual TLS on the xDS port: nothing runs in plaintext, the server and Envoy read their
certificates from whole Secret volumes (so a renewal reaches them), the names and
identities each side checks are the ones the cert-manager component's Certificates carry,
and it works: certificates issued as those Certificates say (a throwaway CA here) let a
real Envoy, with the committed bootstrap and SDS files, get its configuration from the
server started with the Deployment's TLS arguments, and let one replica link to another.

The cert-manager objects have CRDs kubernetes-validate does not know: they get a
structural check against the fields the CRDs define."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import yaml

from tests.k8s.manifests import (
    BOOTSTRAP_ARGUMENTS,
    K8S,
    NAMESPACE,
    ROOT,
    Doc,
    _all,
    _bootstrap,
    _certificate_for,
    _envoy,
    _envoy_sds_files,
    _envoy_tls_secret,
    _is_cert_manager,
    _mount_holding,
    _mounted_volumes,
    _one,
    _one_pool_config,
    _Pki,
    _pod_envoy,
    _server,
    _server_args,
    _server_tls_secret,
    _server_tls_settings,
    _xds_endpoint,
    _xds_tls_context,
)
from xds_server.app import XdsApplication
from xds_server.envoy.bootstrap import render_sds_files
from xds_server.settings import ServerSettings
from xds_testbed.backends import ExampleBackend

COMPONENT = K8S / "components" / "cert-manager"


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
    """Envoy sends the Service's short name (the address it dials, resolved in its own
    namespace) as SNI and requires it among the server certificate's DNS names; the server
    Certificate has it."""
    _, _, bootstrap = _bootstrap(rendered)
    context = _xds_tls_context(bootstrap)
    name = _one(rendered, "Service", "xds-server")["metadata"]["name"]
    assert context["sni"] == name
    validation = context["common_tls_context"]["combined_validation_context"]
    (matcher,) = validation["default_validation_context"]["match_typed_subject_alt_names"]
    assert matcher == {"san_type": "DNS", "matcher": {"exact": name}}

    server_certificate = _certificate_for(rendered, _server_tls_secret(rendered)[0])
    assert _xds_endpoint(bootstrap)["address"] == name
    assert name in server_certificate["spec"]["dnsNames"]
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
    # The SPIFFE-style identities name the service account they are for, in the trust
    # domain of this deployment's own CA; not the namespace, which an overlay may change.
    for identity, deployment in ((args.envoy_identity, _envoy(rendered)),
                                 (args.peer_identity, _server(rendered))):  # fmt: skip
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        assert identity == f"spiffe://xds-server/sa/{account}"


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
    async with _pod_envoy(rendered, pki, tmp_path, address="127.0.0.1") as envoy:
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
