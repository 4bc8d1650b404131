"""The `xds-testbed` command: the local demo, outside the production server.

xds-testbed demo       this server, a real Envoy and simulated GPU pods, on loopback
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence

from xds_server.errors import XdsServerError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xds-testbed", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="default: warning (the demo's live view is its output)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="run the local demo: server, real Envoy, simulated GPU pods"
    )
    demo.add_argument("--port", type=int, default=8080, help="where Envoy accepts requests")
    demo.add_argument("--phase-seconds", type=float, default=15.0, help="traffic per policy")
    demo.add_argument(
        "--duration",
        type=float,
        default=None,
        help="after the comparison, serve this long (default: until Ctrl-C)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from xds_testbed.demo import run_demo

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(
                run_demo(
                    listener_port=args.port, phase_s=args.phase_seconds, duration_s=args.duration
                )
            )
    except (XdsServerError, OSError) as exc:
        logging.getLogger(__name__).critical("%s Exiting.", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
