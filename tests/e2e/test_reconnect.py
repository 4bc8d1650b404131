"""A restarted server gets its Envoys back at once: the bootstrap's xDS retry backoff.

Envoy retries a broken ADS stream with jittered exponential backoff. With Envoy's defaults
(from 0.5 s up to 30 s) the wait grows quickly while the server is away, so a restart or a
rollout left Envoys disconnected for up to 24 s after the new server was up (measured);
the bootstrap caps the backoff at 1 s. Here the server is stopped under a connected, real
Envoy, which must keep retrying (seven refused attempts take at most 4.5 s with the
bootstrap's backoff, about half a minute with the defaults), and a new server on the same
port must then get it back, in both protocols. Every bound is generous, for a busy machine.
"""

from __future__ import annotations

import re
import socket

import pytest

from tests.e2e.conftest import ConfigFile, eventually
from xds_server.app import XdsApplication
from xds_server.envoy import names, render_bootstrap
from xds_server.settings import ServerSettings
from xds_testbed.envoy_process import EnvoyProcess

NODE_ID = "reconnect"

# Far above the second the backoff allows; Envoy's defaults often take longer.
_WITHIN_S = 15.0
# Refused ADS attempts before the new server starts: with the bootstrap's backoff the
# seventh comes at most 4.5 s after the first; with Envoy's defaults, after 30 s or so.
_FAILED_ATTEMPTS = 7


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _stat(envoy: EnvoyProcess, name: str) -> int | None:
    return (await envoy.get_stats(f"^{re.escape(name)}$")).get(name)


def _has_node(app: XdsApplication, protocol: str) -> bool:
    return any(
        record.node_id == NODE_ID and record.protocol == protocol
        for record in app.registry.streams()
    )


@pytest.mark.parametrize("protocol", ["sotw", "delta"])
async def test_envoy_reconnects_to_a_server_restarted_on_the_same_port(  # type: ignore[no-untyped-def]
    backends, config_file: ConfigFile, protocol: str
) -> None:
    backend = await backends("a")
    config_file.write({"pool": (["m"], [(backend, 1)])})
    # Both servers bind this port; Envoy's bootstrap names it.
    settings = ServerSettings(
        config_path=config_file.path, xds_port=_free_port(), admin_port=0, config_poll_s=0.05
    )
    bootstrap = render_bootstrap(
        xds_address="127.0.0.1", xds_port=settings.xds_port, node_id=NODE_ID, node_cluster="e2e",
        admin_port=0, delta=protocol == "delta",
    )  # fmt: skip
    # Without its load reporting stream, which retries every 5 s on its own timer, every
    # refused connection to the xDS cluster is an ADS attempt.
    del bootstrap["cluster_manager"]["load_stats_config"]
    connect_fail = f"cluster.{names.XDS_CLUSTER}.upstream_cx_connect_fail"
    async with EnvoyProcess(bootstrap) as envoy:
        async with XdsApplication(settings) as first:
            await envoy.wait_live(timeout=20)
            assert _has_node(first, protocol)

        await eventually(
            lambda: _is(envoy, "control_plane.connected_state", 0),
            within_s=_WITHIN_S,
            what="Envoy to see the server gone",
        )
        failed_before = await _stat(envoy, connect_fail) or 0
        await eventually(
            lambda: _at_least(envoy, connect_fail, failed_before + _FAILED_ATTEMPTS),
            within_s=_WITHIN_S,
            what=f"Envoy to try {_FAILED_ATTEMPTS} times to reconnect",
        )

        async with XdsApplication(settings) as second:
            await eventually(
                lambda: _is(envoy, "control_plane.connected_state", 1),
                within_s=_WITHIN_S,
                what="Envoy to reconnect to the new server",
            )
            await eventually(
                lambda: _has_node(second, protocol),
                within_s=_WITHIN_S,
                what="the new server to see the node",
            )


async def _is(envoy: EnvoyProcess, name: str, expected: int) -> bool:
    return await _stat(envoy, name) == expected


async def _at_least(envoy: EnvoyProcess, name: str, expected: int) -> bool:
    return (await _stat(envoy, name) or 0) >= expected
