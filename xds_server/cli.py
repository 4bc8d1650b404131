"""The `xds-server` command: run, bootstrap.

xds-server run --config FILE       serve a routing config to Envoys over ADS
xds-server bootstrap ...           print an Envoy bootstrap that points at this server

The local demo is not part of the server: it is `xds-testbed demo` (testbed/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from xds_server.errors import XdsServerError

if TYPE_CHECKING:
    from xds_server.app import XdsApplication

__all__ = ["main"]

logger = logging.getLogger(__name__)


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


async def _run(args: argparse.Namespace) -> None:
    if args.configmap is not None and not args.kubernetes:
        raise SystemExit("xds-server run: --configmap needs --kubernetes")
    if args.peers_selector is not None and not args.kubernetes:
        raise SystemExit("xds-server run: --peers-selector needs --kubernetes")
    given = [f is not None for f in (args.tls_cert, args.tls_key, args.tls_client_ca)]
    if args.plaintext and any(given):
        raise SystemExit("xds-server run: --plaintext and the --tls-* files exclude each other")
    if not args.plaintext and not all(given):
        raise SystemExit(
            "xds-server run: give --tls-cert, --tls-key and --tls-client-ca (mutual TLS),"
            " or --plaintext to serve without TLS (local tests and demos only)"
        )
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


def _bootstrap(args: argparse.Namespace) -> None:
    from xds_server.envoy.bootstrap import BootstrapTls, render_bootstrap, render_sds_files

    if args.plaintext == (args.tls_dir is not None):
        raise SystemExit(
            "xds-server bootstrap: give --tls-dir (mutual TLS to the server), or --plaintext"
        )
    tls = None
    if args.tls_dir is not None:
        tls = BootstrapTls(
            cert_dir=args.tls_dir, sds_dir=args.sds_dir, server_name=args.server_name
        )
    document = render_bootstrap(
        xds_address=args.xds_address,
        xds_port=args.xds_port,
        node_id=args.node_id,
        node_cluster=args.node_cluster,
        admin_port=args.admin_port,
        delta=args.delta,
        tls=tls,
    )
    if args.write_sds is not None:
        if tls is None:
            raise SystemExit("xds-server bootstrap: --write-sds needs --tls-dir")
        args.write_sds.mkdir(parents=True, exist_ok=True)
        for name, content in render_sds_files(tls).items():
            (args.write_sds / name).write_text(yaml.safe_dump(content, sort_keys=False))
    if args.format == "json":
        print(json.dumps(document, indent=2))
    else:
        print(yaml.safe_dump(document, sort_keys=False), end="")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xds-server", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="info: connects, disconnects, config changes and NACKs",
    )
    parser.add_argument("--log-format", default="text", choices=["text", "json"])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="serve a routing config to Envoys over ADS")
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="routing config (YAML), re-read on change")
    source.add_argument(
        "--configmap", help="the ConfigMap holding the routing config (with --kubernetes)"
    )
    run.add_argument(
        "--kubernetes",
        action="store_true",
        help="discover pods and Inference Extension objects through the Kubernetes API",
    )
    run.add_argument("--namespace", help="the server's namespace (default: its service account's)")
    run.add_argument(
        "--watch-namespace",
        action="append",
        help="where to look for pods and InferencePools (repeatable; default: --namespace)",
    )
    run.add_argument(
        "--kubeconfig", type=Path, help="outside a cluster: the kubeconfig (default ~/.kube/config)"
    )
    run.add_argument("--xds-address", default="127.0.0.1", help="gRPC ADS bind address")
    run.add_argument("--xds-port", type=int, default=18000)
    run.add_argument("--admin-address", default="127.0.0.1", help="admin/metrics bind address")
    run.add_argument("--admin-port", type=int, default=9000)
    run.add_argument(
        "--debug-address",
        default="127.0.0.1",
        help="bind address of the debug views (/debug/*); keep it loopback unless they must be"
        " reachable from elsewhere",
    )
    run.add_argument(
        "--debug-port", type=int, help="port of the debug views (default: --admin-port + 1)"
    )
    run.add_argument(
        "--config-poll", type=float, default=1.0, help="seconds between config file checks"
    )
    run.add_argument(
        "--replica",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="this replica's name, as its peers know it (default: $POD_NAME, else the host name)",
    )
    tls = run.add_argument_group("mutual TLS on the gRPC port (ADS, LRS, ALS, peers)")
    tls.add_argument("--tls-cert", type=Path, help="the server's certificate chain (PEM)")
    tls.add_argument("--tls-key", type=Path, help="the server's private key (PEM)")
    tls.add_argument(
        "--tls-client-ca", type=Path, help="the CA clients' certificates must chain to (PEM)"
    )
    tls.add_argument(
        "--envoy-identity",
        help="the subject alternative name an Envoy's certificate must carry ({node_id}: its"
        " node id); default: any certificate of the client CA",
    )
    tls.add_argument(
        "--peer-identity",
        help="the subject alternative name a peer replica's certificate must carry",
    )
    tls.add_argument("--peer-server-name", help="the name the peers' server certificates are for")
    tls.add_argument(
        "--plaintext",
        action="store_true",
        help="serve without TLS: anyone who reaches the port is trusted (tests, demos)",
    )
    peers = run.add_mutually_exclusive_group()
    peers.add_argument(
        "--peer",
        action="append",
        metavar="HOST:PORT",
        help="another server replica's xDS address, to share Envoy load with (repeatable)",
    )
    peers.add_argument(
        "--peers-selector",
        metavar="LABELS",
        help="find the other replicas as the Ready pods of this label selector in --namespace",
    )

    boot = commands.add_parser(
        "bootstrap", help="print an Envoy bootstrap that points at this server"
    )
    boot.add_argument("--xds-address", default="127.0.0.1")
    boot.add_argument("--xds-port", type=int, default=18000)
    boot.add_argument("--node-id", default="envoy-0")
    boot.add_argument("--node-cluster", default="llm-gateway")
    boot.add_argument("--admin-port", type=int, default=9901)
    boot.add_argument("--delta", action="store_true", help="use incremental (Delta) xDS")
    boot.add_argument("--format", default="yaml", choices=["yaml", "json"])
    boot_tls = boot.add_mutually_exclusive_group()
    boot_tls.add_argument(
        "--tls-dir",
        help="mutual TLS: the directory of the client certificate (tls.crt, tls.key, ca.crt)",
    )
    boot_tls.add_argument(
        "--plaintext", action="store_true", help="connect to the server without TLS"
    )
    boot.add_argument("--sds-dir", default="/etc/envoy/sds", help="where Envoy reads its SDS files")
    boot.add_argument(
        "--server-name",
        default="xds-server.xds-server.svc",
        help="the name the server's certificate is for (SNI and subject alternative name)",
    )
    boot.add_argument(
        "--write-sds", type=Path, metavar="DIR", help="also write the SDS files into DIR"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format)
    if args.command == "bootstrap":
        _bootstrap(args)
        return 0
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_run(args))
    except (XdsServerError, OSError) as exc:
        logger.critical("%s Exiting.", exc, exc_info=isinstance(exc, XdsServerError))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
