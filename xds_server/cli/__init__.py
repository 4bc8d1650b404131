"""The `xds-server` command.

xds-server run --config FILE       serve a routing config to Envoys over ADS (serve.py)
xds-server bootstrap ...           print an Envoy bootstrap that points at this server
xds-server check-config FILE       validate a routing config as the server would, offline
xds-server --version               the installed version

Every flag is also an `XDS_SERVER_*` environment variable (environment.py); logs are in
UTC to the millisecond (logs.py). The local demo is not part of the server: it is
`xds-testbed demo` (testbed/).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from xds_server.cli.logs import configure_logging
from xds_server.cli.parser import build_parser

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command `argv` (None: the process's arguments); return its exit status."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.command == "bootstrap":
        from xds_server.cli.bootstrap import print_bootstrap

        return print_bootstrap(args)
    if args.command == "check-config":
        from xds_server.cli.check_config import check_config

        return check_config(args.file, previous=args.previous, kubernetes=args.kubernetes)
    from xds_server.cli.serve import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
