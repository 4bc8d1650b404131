"""`xds-server bootstrap`: print an Envoy bootstrap that points at this server."""

from __future__ import annotations

import argparse
import json

import yaml

__all__ = ["print_bootstrap"]


def print_bootstrap(args: argparse.Namespace) -> int:
    """Print the bootstrap the parsed flags of `bootstrap` describe (and write its SDS files
    with --write-sds); return the exit status."""
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
    if args.stats_port is not None and args.admin_port == 0:
        raise SystemExit(
            "xds-server bootstrap: --stats-port forwards to the admin port: give a fixed"
            " --admin-port"
        )
    document = render_bootstrap(
        xds_address=args.xds_address,
        xds_port=args.xds_port,
        node_id=args.node_id,
        node_cluster=args.node_cluster,
        admin_port=args.admin_port,
        delta=args.delta,
        tls=tls,
        stats_port=args.stats_port,
        stats_address=args.stats_address,
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
    return 0
