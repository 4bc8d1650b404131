from __future__ import annotations

import os

import pytest

from xds_testbed import EnvoyError, EnvoyProcess
from xds_testbed.envoy_process import EnvoyState, find_envoy

MINIMAL: dict[str, object] = {"static_resources": {}}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_binary_is_found() -> None:
    assert os.access(find_envoy(), os.X_OK)


async def test_start_query_and_stop() -> None:
    async with EnvoyProcess(MINIMAL) as envoy:
        assert envoy.state is EnvoyState.OPEN
        assert envoy.admin_url.startswith("http://127.0.0.1:")
        assert _alive(envoy.pid)
        await envoy.wait_live()
        assert "configs" in await envoy.config_dump()
        assert await envoy.clusters_json() == {}  # no clusters
        stats = await envoy.get_stats(r"^server\.live$")
        assert stats == {"server.live": 1}
        with pytest.raises(EnvoyError, match="no listener named"):
            await envoy.listener_port("nope")
        pid = envoy.pid
    assert envoy.state is EnvoyState.CLOSED
    assert not _alive(pid)
    with pytest.raises(RuntimeError, match="closed"):
        await envoy.get_stats()


async def test_a_process_cannot_be_entered_twice() -> None:
    envoy = EnvoyProcess(MINIMAL)
    async with envoy:
        with pytest.raises(RuntimeError, match="open"):
            await envoy.__aenter__()


async def test_a_refused_bootstrap_raises_with_envoys_reason() -> None:
    envoy = EnvoyProcess({"static_resources": {"no_such_field": 1}})
    with pytest.raises(EnvoyError) as caught:
        async with envoy:
            pass
    message = str(caught.value)
    assert "exited" in message
    assert "no_such_field" in message  # from Envoy's stderr
    assert envoy.state is EnvoyState.CLOSED


async def test_wait_for_times_out_with_a_clear_error() -> None:
    async with EnvoyProcess(MINIMAL) as envoy:
        with pytest.raises(EnvoyError, match="did not see the impossible"):
            await envoy.wait_for(lambda: False, 0.1, what="see the impossible")
        assert await envoy.wait_for(lambda: 7, 1) == 7
