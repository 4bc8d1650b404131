"""Throwaway certificates for tests and demos of mutual TLS.

Each certificate is written as a Kubernetes TLS Secret lays its keys out (and cert-manager
fills them): `tls.crt`, `tls.key` and `ca.crt` in one directory, which is what the server
(`--tls-cert/--tls-key/--tls-client-ca`) and `xds-server bootstrap --tls-dir` read.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertificateAuthority", "IssuedCertificate"]

_VALIDITY = datetime.timedelta(days=2)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` in one rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class IssuedCertificate:
    """Where one issued certificate's Secret-like directory is."""

    directory: Path

    @property
    def cert(self) -> Path:
        return self.directory / "tls.crt"

    @property
    def key(self) -> Path:
        return self.directory / "tls.key"

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    def serial(self) -> int:
        return x509.load_pem_x509_certificate(self.cert.read_bytes()).serial_number


class CertificateAuthority:
    """A self-signed CA that issues leaf certificates into directories."""

    def __init__(self, name: str = "xds-testbed CA") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        directory: Path,
        *,
        dns: Sequence[str] = (),
        uris: Sequence[str] = (),
        ips: Sequence[str] = (),
    ) -> IssuedCertificate:
        """A certificate for these subject alternative names, usable as a server's and a
        client's, written (atomically, file by file) into `directory`."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.UniformResourceIdentifier(u) for u in uris]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        common_name = (list(dns) + list(uris) + ["leaf"])[0][:64]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        issued = IssuedCertificate(directory)
        _write_atomically(issued.ca, self.pem)
        _write_atomically(issued.key, _pem_key(key))
        _write_atomically(issued.cert, cert.public_bytes(serialization.Encoding.PEM))
        return issued
