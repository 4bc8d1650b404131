"""The manifests rendered once for tests/k8s (`kubectl kustomize`: the base, and the base
with every component), and the certificates cert-manager would issue for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.k8s.manifests import (
    COMPONENTS,
    EXAMPLES,
    K8S,
    Doc,
    _certificate_for,
    _envoy_tls_secret,
    _kustomize,
    _kustomize_overlay,
    _Pki,
    _server_tls_secret,
)
from xds_testbed.certs import CertificateAuthority, IssuedCertificate


@pytest.fixture(scope="package")
def base() -> list[Doc]:
    """`kubectl kustomize k8s/`: the base alone."""
    return _kustomize(K8S)


@pytest.fixture(scope="package")
def rendered() -> list[Doc]:
    """The base with every optional component (k8s/components/), in its own namespace."""
    return _kustomize_overlay(COMPONENTS)


@pytest.fixture(scope="package")
def examples() -> list[Doc]:
    return _kustomize(EXAMPLES)


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
