"""The route table of pools with different API lists (`pools[].api`), loaded by a real
Envoy 1.40: every path alternation within RE2's program size limit, and the or_match of a
pool's models, are accepted (Envoy refuses a whole route config otherwise)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.envoy.static_bootstrap import static_bootstrap
from tests.envoy.test_build_path_routes import ALL_APIS, APIS_YAML
from xds_server.config import parse_config
from xds_testbed.envoy_process import find_envoy


def test_envoy_loads_the_routes_of_every_api(tmp_path: Path) -> None:
    config = parse_config(APIS_YAML)
    assert list(config.pools[-1].api) == ALL_APIS
    bootstrap = static_bootstrap(config)
    bootstrap["admin"] = {
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}
    }
    path = tmp_path / "bootstrap.json"
    path.write_text(json.dumps(bootstrap))
    validated = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert validated.returncode == 0, validated.stdout[-2000:] + validated.stderr[-2000:]
    assert "configuration 'static" not in validated.stderr
