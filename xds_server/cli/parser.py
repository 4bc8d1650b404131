"""The command line: `run`, `bootstrap` and `check-config`, each flag also an
`XDS_SERVER_*` environment variable (environment.py), each default shown in `--help`."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from xds_server.cli.environment import EnvironmentParser
from xds_server.telemetry.build_info import package_version

__all__ = ["build_parser"]

DESCRIPTION = "An xDS management server for GPU-aware balancing of LLM traffic by Envoy."


def build_parser(environ: Mapping[str, str] | None = None) -> EnvironmentParser:
    """The `xds-server` command's parser; flags also read from `environ` (None:
    os.environ at parse time)."""
    parser = EnvironmentParser(
        prog="xds-server",
        description=DESCRIPTION,
        environ=environ,
        epilog="Every flag can also be set by the environment variable shown beside it; a flag"
        " on the command line wins.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="info: connects, disconnects, config changes and NACKs",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text, or one JSON object per line; times in UTC to the millisecond",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run(commands)
    _add_bootstrap(commands)
    _add_check_config(commands)
    # bootstrap's flags describe an Envoy: XDS_SERVER_BOOTSTRAP_*, apart from the server's.
    parser.take_environment(command_prefixes={"bootstrap": "BOOTSTRAP_"})
    return parser


def _add_run(commands: argparse._SubParsersAction[EnvironmentParser]) -> None:
    run = commands.add_parser("run", help="serve a routing config to Envoys over ADS")
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--config", type=Path, help="the routing config file (YAML or JSON), re-read on change"
    )
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
    run.add_argument("--xds-port", type=int, default=18000, help="gRPC ADS port")
    run.add_argument("--admin-address", default="127.0.0.1", help="admin/metrics bind address")
    run.add_argument(
        "--admin-port", type=int, default=9000, help="admin/metrics port (0: any free port)"
    )
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
        help="the subject alternative name a peer replica's certificate must carry; default: any"
        " certificate of the client CA",
    )
    tls.add_argument(
        "--peer-server-name",
        help="the name the peers' server certificates are for (default: the peer's address)",
    )
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
    run.flags_exclude(["plaintext"], ["tls_cert", "tls_key", "tls_client_ca"])


def _add_bootstrap(commands: argparse._SubParsersAction[EnvironmentParser]) -> None:
    boot = commands.add_parser(
        "bootstrap", help="print an Envoy bootstrap that points at this server"
    )
    boot.add_argument(
        "--xds-address", default="127.0.0.1", help="where the Envoy finds this server"
    )
    boot.add_argument("--xds-port", type=int, default=18000, help="this server's gRPC ADS port")
    boot.add_argument("--node-id", default="envoy-0", help="the Envoy's node id")
    boot.add_argument("--node-cluster", default="llm-gateway", help="the Envoy's node cluster")
    boot.add_argument("--admin-port", type=int, default=9901, help="the Envoy's admin port")
    boot.add_argument(
        "--stats-port",
        type=int,
        help="a listener on this port that serves GET /stats/prometheus (Envoy's stats for"
        " Prometheus) and nothing else; none without it",
    )
    boot.add_argument(
        "--stats-address", default="0.0.0.0", help="the address of the stats listener"
    )
    boot.add_argument("--delta", action="store_true", help="use incremental (Delta) xDS")
    boot.add_argument("--format", default="yaml", choices=["yaml", "json"], help="output format")
    boot_tls = boot.add_mutually_exclusive_group()
    boot_tls.add_argument(
        "--tls-dir",
        help="mutual TLS: the directory of the client certificate (tls.crt, tls.key, ca.crt)",
    )
    boot_tls.add_argument(
        "--plaintext", action="store_true", help="connect to the server without TLS"
    )
    boot.add_argument(
        "--sds-dir", default="/etc/envoy/sds", help="where Envoy reads its SDS files"
    )
    boot.add_argument(
        "--server-name",
        default="xds-server.xds-server.svc",
        help="the name the server's certificate is for (SNI and subject alternative name)",
    )
    boot.add_argument(
        "--write-sds", type=Path, metavar="DIR", help="also write the SDS files into DIR"
    )


def _add_check_config(commands: argparse._SubParsersAction[EnvironmentParser]) -> None:
    check = commands.add_parser(
        "check-config",
        help="validate a routing config as the server would, offline (exit 0, or 1 naming"
        " every problem)",
        description="Validate a routing config as the server would, offline: exit 0 if the"
        " server would apply it, 1 with every problem named by its field path.",
    )
    check.add_argument(
        "file", metavar="FILE", help="the routing config (YAML or JSON); - reads stdin"
    )
    check.add_argument(
        "--previous",
        type=Path,
        metavar="FILE",
        help="the config in force: also refuse what the server refuses as an edit of it (a"
        " pool's last listed endpoints taken away)",
    )
    check.add_argument(
        "--kubernetes",
        action="store_true",
        help="judge as a server run with --kubernetes (pools' selectors are followed)",
    )
