"""`xds-server run`: serve a routing config to Envoys over ADS until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
from typing import TYPE_CHECKING

from xds_server.cli.environment import origin_of
from xds_server.errors import XdsServerError

if TYPE_CHECKING:
    from xds_server.app import XdsApplication

__all__ = ["serve"]

logger = logging.getLogger(__name__)


def serve(args: argparse.Namespace) -> int:
    """Run the server with the parsed flags of `run`; return the exit status (1: it could
    not start or a background task failed, logged)."""
    _check_flags(args)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_run(args))
    except (XdsServerError, OSError) as exc:
        logger.critical("%s Exiting.", exc, exc_info=isinstance(exc, XdsServerError))
        return 1
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Exit with a message naming the flags (or their variables) that do not go together."""

    def named(dest: str) -> str:
        return origin_of(args, dest, "--" + dest.replace("_", "-"))

    if not args.kubernetes:
        for dest in ("configmap", "peers_selector"):
            if getattr(args, dest) is not None:
                raise SystemExit(f"xds-server run: {named(dest)} needs {named('kubernetes')}")
    files = ("tls_cert", "tls_key", "tls_client_ca")
    given = [getattr(args, dest) is not None for dest in files]
    if args.plaintext and any(given):
        raise SystemExit(
            f"xds-server run: {named('plaintext')} and the TLS files"
            f" ({', '.join(named(d) for d in files if getattr(args, d) is not None)})"
            " exclude each other"
        )
    if not args.plaintext and not all(given):
        raise SystemExit(
            "xds-server run: give --tls-cert, --tls-key and --tls-client-ca (mutual TLS),"
            " or --plaintext to serve without TLS (local tests and demos only)"
        )


async def _run(args: argparse.Namespace) -> None:
    from xds_server.app import XdsApplication
    from xds_server.settings import KubernetesSettings, ServerSettings, TlsSettings

    tls = None
    if not args.plaintext:
        tls = TlsSettings(
            cert=args.tls_cert,
            key=args.tls_key,
            client_ca=args.tls_client_ca,
            envoy_identity=args.envoy_identity,
            peer_identity=args.peer_identity,
            peer_server_name=args.peer_server_name,
        )

    kubernetes = None
    if args.kubernetes:
        from xds_server.sources.kubernetes.client import own_namespace

        namespace = args.namespace or own_namespace()
        kubernetes = KubernetesSettings(
            namespace=namespace,
            watch_namespaces=tuple(args.watch_namespace or (namespace,)),
            configmap=args.configmap,
            kubeconfig=args.kubeconfig,
        )
    settings = ServerSettings(
        config_path=args.config,
        kubernetes=kubernetes,
        xds_host=args.xds_address,
        xds_port=args.xds_port,
        admin_host=args.admin_address,
        admin_port=args.admin_port,
        debug_host=args.debug_address,
        debug_port=args.debug_port,
        config_poll_s=args.config_poll,
        replica=args.replica,
        peers=tuple(args.peer or ()),
        peers_selector=args.peers_selector,
        tls=tls,
    )
    # Young objects are collected every 10,000 allocations rather than 700: a push to
    # hundreds of Envoys allocates that many in a blink, and each full collection walks
    # every object the server holds (50-100 ms at fleet size), now 14 times less often.
    gc.set_threshold(10_000, 10, 10)
    async with XdsApplication(settings) as app:
        # What is loaded by now (modules, protobuf descriptors: ~80,000 objects) lives as long
        # as the process: out of the collector's sight, a full collection takes microseconds,
        # not the ~100 ms it would hold the event loop for.
        gc.freeze()
        signalled = asyncio.create_task(_until_signalled())
        serving = asyncio.create_task(app.serve_forever())
        frozen = asyncio.create_task(_freeze_when_ready(app))
        done, pending = await asyncio.wait(
            {signalled, serving}, return_when=asyncio.FIRST_COMPLETED
        )
        frozen.cancel()
        for task in pending:
            task.cancel()
        if serving in done:
            serving.result()  # a failed background task: exit non-zero with its cause


async def _freeze_when_ready(app: XdsApplication) -> None:
    """Once the first snapshot is in, freeze again: the config and what was built from it
    (10,000 endpoints: some 100,000 objects) mostly live until the next config, and each
    full collection would walk them all."""
    await app.controller.settled()
    gc.freeze()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("Shutting down.")
