"""Following a config file: changes are yielded, bad content is yielded as an error."""

from __future__ import annotations

from pathlib import Path

from xds_server.config import RoutingConfig
from xds_server.errors import ConfigError
from xds_server.sources.config_file import watch_config_file

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
