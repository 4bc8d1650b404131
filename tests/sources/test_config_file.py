"""Following a config file: changes are yielded, bad content is yielded as an error, and a
hostile file is refused while the server keeps answering."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from tests.e2e.conftest import eventually
from tests.sources.stalls import BOUND_S, alias_bomb, giant_document, least_stalls, slow_document
from xds_server.app import XdsApplication
from xds_server.config import RoutingConfig
from xds_server.errors import ConfigError
from xds_server.settings import ServerSettings
from xds_server.sources.config_file import watch_config_file
from xds_server.telemetry import Telemetry

GOOD = "pools: [{name: a, models: [m]}]"


async def test_yields_on_change_only(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(GOOD)
    seen = []
    async for item in watch_config_file(path, interval_s=0, _iterations=3):
        seen.append(item)
        if len(seen) == 1:
            path.write_text(GOOD)  # same content: nothing new
    assert len(seen) == 1 and isinstance(seen[0], RoutingConfig)


@pytest.mark.parametrize("how", ["in place", "renamed over", "symlink swapped"])
async def test_a_change_is_seen_at_once_not_at_the_next_poll(tmp_path: Path, how: str) -> None:
    """The directory is watched (inotify): a write, an atomic rename over the file, or a
    ConfigMap-style symlink swap is read within moments, though the poll is minutes away."""
    path = tmp_path / "config.yaml"
    if how == "symlink swapped":
        (tmp_path / "v1").mkdir()
        (tmp_path / "v1" / "config.yaml").write_text(GOOD)
        (tmp_path / "..data").symlink_to("v1")
        path.symlink_to("..data/config.yaml")
    else:
        path.write_text(GOOD)
    changed = "pools: [{name: b, models: [m]}]"
    loop = asyncio.get_running_loop()
    written_at = 0.0
    seen: list[RoutingConfig | ConfigError] = []
    async with asyncio.timeout(60):
        async for item in watch_config_file(path, interval_s=300):
            seen.append(item)
            if len(seen) == 2:
                break
            await asyncio.sleep(0.2)  # the watcher is back to waiting
            written_at = loop.time()
            if how == "in place":
                path.write_text(changed)
            elif how == "renamed over":
                (tmp_path / "next.yaml").write_text(changed)
                os.replace(tmp_path / "next.yaml", path)
            else:
                (tmp_path / "v2").mkdir()
                (tmp_path / "v2" / "config.yaml").write_text(changed)
                (tmp_path / "..data_next").symlink_to("v2")
                os.replace(tmp_path / "..data_next", tmp_path / "..data")
    assert isinstance(seen[1], RoutingConfig) and seen[1].pools[0].name == "b"
    # Far sooner than the 300 s poll (a parse in a warm child takes a fraction of a second).
    assert loop.time() - written_at < 30


async def test_bad_then_good_then_missing(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("pools: []")
    seen = []
    async for item in watch_config_file(path, interval_s=0, _iterations=4):
        seen.append(item)
        if len(seen) == 1:
            path.write_text(GOOD)
        elif len(seen) == 2:
            path.unlink()
    assert isinstance(seen[0], ConfigError) and "pools" in str(seen[0])
    assert isinstance(seen[1], RoutingConfig)
    assert isinstance(seen[2], ConfigError) and "cannot read" in str(seen[2])
    assert len(seen) == 3


async def test_a_file_over_the_size_cap_is_refused_and_a_good_one_is_taken_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(GOOD)
    giant = giant_document(50)
    seen = []
    async for item in watch_config_file(path, interval_s=0, _iterations=3):
        seen.append(item)
        if len(seen) == 1:
            path.write_bytes(giant)
        elif len(seen) == 2:
            path.write_text(GOOD)
    assert isinstance(seen[0], RoutingConfig) and isinstance(seen[2], RoutingConfig)
    assert str(seen[1]) == f"{path}: refused: {len(giant)} bytes, over the limit of 1048576 bytes"


def _write(path: Path, document: bytes) -> None:
    """Replace the file at once, as a ConfigMap mount does (no half-written file is read)."""
    part = path.with_suffix(".part")
    part.write_bytes(document)
    os.replace(part, path)


APP_CONFIG = """
listener: {address: 127.0.0.1, port: 0}
updates: {debounce_s: 0.01}
pools: [{name: pool, models: [m], endpoints: [{address: 127.0.0.1, port: 9}]}]
"""


async def test_hostile_files_are_refused_while_the_server_keeps_answering(
    tmp_path: Path,
) -> None:
    """The issue's attacks through the real server: each refused with what was wrong,
    counted, the last good config kept, and the loop stalled less than BOUND_S."""
    hostile = {
        "a 43 MB file": (giant_document(50), "over the limit of 1048576 bytes"),
        "an alias bomb": (alias_bomb().encode(), "more than 256 YAML aliases"),
        "0.9 MB within the limits": (slow_document(), "endpoint 10.0.0.0:8000 listed twice"),
    }
    path = tmp_path / "config.yaml"
    path.write_text(APP_CONFIG)
    settings = ServerSettings(config_path=path, xds_port=0, admin_port=0, config_poll_s=0.05)
    async with XdsApplication(settings) as app:
        await app.wait_ready(within_s=30)
        good = app.controller.config
        registry = app.telemetry.registry
        refused = 0.0

        def errors() -> float:
            return registry.get_sample_value("xds_config_reloads_total", {"result": "error"}) or 0

        for name, (document, message) in hostile.items():

            async def attempt(i: int, document: bytes = document) -> None:
                nonlocal refused
                # A longer comment each time: a new document (and size) to refuse.
                await asyncio.to_thread(_write, path, document + b"#" * (i + 1) + b"\n")
                refused += 1
                await eventually(lambda: errors() == refused, within_s=60, what="the refusal")

            stalls = await least_stalls(
                attempt, probe_url=f"http://127.0.0.1:{app.admin_port}/healthz"
            )
            assert stalls.worst_s < BOUND_S, (name, stalls)
            assert stalls.probes > 0
            assert message in (app.controller.last_error or ""), name
            assert app.controller.config == good, name
            assert registry.get_sample_value("xds_config_last_reload_successful") == 0


async def test_a_change_that_empties_a_pool_is_refused_unless_the_pool_allows_it(
    tmp_path: Path,
) -> None:
    """Compared with the config yielded last: a pool whose endpoints all go is refused;
    with `allow_empty` it is accepted (with the warning), and once empty it stays
    accepted without."""
    path = tmp_path / "config.yaml"
    path.write_text("pools: [{name: a, models: [m], endpoints: [{address: 10.0.0.1, port: 80}]}]")
    emptied = "pools: [{name: a, models: [m]}]"
    then = iter(
        [
            emptied,
            "pools: [{name: a, models: [m], allow_empty: true}]",
            emptied + "  # already empty",
        ]
    )
    telemetry = Telemetry()
    seen: list[RoutingConfig | ConfigError] = []
    async with asyncio.timeout(60):
        async for item in watch_config_file(path, interval_s=0.05, telemetry=telemetry):
            seen.append(item)
            document = next(then, None)
            if document is None:
                break
            _write(path, document.encode())
    refused, allowed, stays = seen[1:]
    assert isinstance(seen[0], RoutingConfig) and len(seen[0].pools[0].endpoints) == 1
    assert isinstance(refused, ConfigError)
    assert str(refused) == (
        f"{path}: refused: it would leave 1 pool(s) that listed endpoints with none: 'a' (had 1),"
        " and their models answered 503 no_healthy_upstream (`allow_empty: true` on a pool"
        " empties it on purpose)"
    )
    assert isinstance(allowed, RoutingConfig) and allowed.pools[0].allow_empty
    assert isinstance(stays, RoutingConfig) and stays.pools[0].endpoints == ()
    warnings = telemetry.registry.get_sample_value(
        "xds_config_warnings_total", {"reason": "pool_without_endpoints"}
    )
    assert warnings == 2  # the two accepted empty configs; the refused one is not counted


async def test_a_file_past_the_parse_time_bound_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(slow_document())
    (item,) = [i async for i in watch_config_file(path, parse_timeout_s=0.05, _iterations=1)]
    assert str(item) == f"{path}: refused: parsing took longer than 0.05 s"


@pytest.mark.parametrize(
    ("pools", "selectors_followed", "empty"),
    [
        ("[{name: a, models: [m], endpoints: [{address: 10.0.0.1, port: 80}]}]", False, []),
        ("[{name: a, models: [m]}, {name: b, models: [n], endpoints: []}]", False, ["a", "b"]),
        ("[{name: a, models: [m], selector: {match_labels: {app: a}, target_port: 80}}]", True, []),
        (
            "[{name: a, models: [m], selector: {match_labels: {app: a}, target_port: 80}}]",
            False,
            ["a"],
        ),
        ("[{name: a, models: [m]}]", True, ["a"]),
    ],
)
async def test_a_config_leaving_pools_without_endpoints_is_accepted_with_a_warning(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    pools: str,
    selectors_followed: bool,
    empty: list[str],
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"pools: {pools}")
    telemetry = Telemetry()
    with caplog.at_level(logging.WARNING, logger="xds_server.sources"):
        (item,) = [
            i
            async for i in watch_config_file(
                path, selectors_followed=selectors_followed, telemetry=telemetry, _iterations=1
            )
        ]
    assert isinstance(item, RoutingConfig)
    warnings = telemetry.registry.get_sample_value(
        "xds_config_warnings_total", {"reason": "pool_without_endpoints"}
    )
    assert warnings == len(empty)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if not empty:
        assert logged == []
    else:
        (line,) = logged
        assert line.startswith(f"{path}: accepted, but {len(empty)} pool(s) have no endpoints")
        assert line.endswith(
            f"{', '.join(repr(n) for n in empty)}. "
            "Their models are answered 503 no_healthy_upstream."
        )
