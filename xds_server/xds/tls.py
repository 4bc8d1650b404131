"""Mutual TLS for the gRPC port (ADS, LRS, ALS and the peers' load streams).

The server's certificate and key, and the CA its clients' certificates must chain to, are
read from files, and read again when they change on disk: gRPC asks before every new
handshake (`dynamic_ssl_server_credentials`), so a rotated certificate (cert-manager
renewing a Secret, which Kubernetes swaps in with a symlink) is used by the next
connection without a restart, and the streams already open keep theirs. A half-written
file does not replace a good certificate: it is logged and the last good one stays.

The same files make the client credentials a replica uses towards its peers.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = ["TlsCredentials", "TlsFiles"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TlsFiles:
    """Where the server's certificate chain, its private key and the client CA are (PEM)."""

    cert: Path
    key: Path
    client_ca: Path

    def paths(self) -> tuple[Path, Path, Path]:
        return (self.cert, self.key, self.client_ca)


@dataclass(frozen=True)
class _Loaded:
    signature: tuple[tuple[int, int], ...]
    cert: bytes
    key: bytes
    client_ca: bytes


class TlsCredentials:
    """The server's TLS material, reloaded from `files` when they change.

    Mutable state: the last good material, behind a lock (gRPC calls `_fetch` from its own
    threads).
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._loaded = self._load()

    def _signature(self) -> tuple[tuple[int, int], ...]:
        stats = [path.stat() for path in self.files.paths()]
        return tuple((s.st_mtime_ns, s.st_size) for s in stats)

    def _load(self) -> _Loaded:
        """Read the three files and check that they make a usable pair and CA; raises
        OSError or ValueError naming what is wrong (a rotation caught half-way: a new
        certificate beside the old key)."""
        signature = self._signature()
        contents = []
        for path in self.files.paths():
            data = path.read_bytes()
            if b"-----BEGIN " not in data:
                raise ValueError(f"{path} holds no PEM block")
            contents.append(data)
        cert, key, client_ca = contents
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.files.cert, self.files.key)
            context.load_verify_locations(cadata=client_ca.decode(errors="replace"))
        except ssl.SSLError as exc:
            raise ValueError(
                f"{self.files.cert} and {self.files.key} are not a certificate and its key,"
                f" or {self.files.client_ca} is not a CA certificate ({exc.reason})"
            ) from exc
        return _Loaded(signature=signature, cert=cert, key=key, client_ca=client_ca)

    def _configuration(self, loaded: _Loaded) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(loaded.key, loaded.cert)], root_certificates=loaded.client_ca
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question before a handshake: new material, or None to keep the current."""
        with self._lock:
            try:
                if self._signature() == self._loaded.signature:
                    return None
                loaded = self._load()
            except (OSError, ValueError) as exc:
                logger.error("Cannot reload the TLS files: %s. Keeping the last good ones.", exc)
                return None
            self._loaded = loaded
        logger.info("TLS certificate reloaded from %s.", self.files.cert)
        return self._configuration(loaded)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that require a client certificate chaining to the client CA."""
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(self._loaded), self._fetch, require_client_authentication=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials towards a peer replica: this server's own certificate, and its
        CA as the roots (the current files: a new channel takes a rotated certificate)."""
        self._fetch()
        with self._lock:
            loaded = self._loaded
        return grpc.ssl_channel_credentials(
            root_certificates=loaded.client_ca,
            private_key=loaded.key,
            certificate_chain=loaded.cert,
        )
