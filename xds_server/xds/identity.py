"""Who may speak for an Envoy node, or for a peer replica.

Over mutual TLS every client holds a certificate from the client CA (tls.py); this decides
what that certificate may do. An Envoy's node id must match its certificate: the
identity `envoy_identity` makes of the node id (`{node_id}` is replaced by it, e.g.
`spiffe://cluster.local/ns/gateway/envoy/{node_id}` for per-pod certificates, or a fixed
`spiffe://cluster.local/ns/gateway/sa/envoy` for a certificate all Envoys share, which
then authenticates "an Envoy of ours" and not one node) must be one of the certificate's
subject alternative names (URI, DNS, ...). A peer replica's certificate must carry
`peer_identity`. A stream that fails is refused with PERMISSION_DENIED before anything is
read from it or sent on it, logged and counted (`xds_auth_refusals_total`).

Without TLS (plaintext, asked for explicitly) nothing is checked: the network is trusted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

__all__ = ["Authenticator", "IdentityPolicy"]

logger = logging.getLogger(__name__)

NODE_ID_PLACEHOLDER = "{node_id}"


@dataclass(frozen=True, kw_only=True)
class IdentityPolicy:
    """What the clients' certificates must say (None: any certificate of the CA will do)."""

    envoy_identity: str | None = None
    peer_identity: str | None = None


def _names(context: grpc.aio.ServicerContext[Any, Any]) -> list[str] | None:
    """The subject alternative names of the client's certificate; None over plaintext."""
    auth = context.auth_context()
    if not auth.get("transport_security_type"):
        return None
    return [n.decode(errors="replace") for n in auth.get("x509_subject_alternative_name", [])]


class Authenticator:
    """Checks a stream's client against `policy` (when `tls` is on)."""

    def __init__(self, *, tls: bool, policy: IdentityPolicy, registry: CollectorRegistry) -> None:
        self._tls = tls
        self._policy = policy
        self._refusals = Counter(
            "xds_auth_refusals",
            "Streams refused because the client's certificate does not match what it claims.",
            ["service", "reason"],
            registry=registry,
        )

    async def admit_envoy(
        self, context: grpc.aio.ServicerContext[Any, Any], *, node_id: str, service: str
    ) -> None:
        """Return if the client may speak for Envoy `node_id`; else abort the stream."""
        if not self._tls:
            return
        if not node_id:
            await self._refuse(context, service, "no_node", "the stream names no node")
        expected = self._policy.envoy_identity
        if expected is None:
            return
        expected = expected.replace(NODE_ID_PLACEHOLDER, node_id)
        names = _names(context) or []
        if expected not in names:
            await self._refuse(
                context,
                service,
                "identity_mismatch",
                f"node {node_id!r} needs a certificate for {expected!r}; this one is for"
                f" {', '.join(map(repr, names)) or 'no name'}",
            )

    async def admit_peer(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Return if the client is a peer replica; else abort the stream."""
        expected = self._policy.peer_identity
        if not self._tls or expected is None:
            return
        names = _names(context) or []
        if expected not in names:
            await self._refuse(
                context,
                "peering",
                "identity_mismatch",
                f"a peer needs a certificate for {expected!r}; this one is for"
                f" {', '.join(map(repr, names)) or 'no name'}",
            )

    async def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], service: str, reason: str, why: str
    ) -> None:
        self._refusals.labels(service, reason).inc()
        logger.warning("Refused a %s stream from %s: %s.", service, context.peer(), why)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
