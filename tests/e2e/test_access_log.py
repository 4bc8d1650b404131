"""The request access log, written by a real Envoy configured by this server.

One JSON line per request with every field of access_log.FIELDS: model, adapter, band,
pool, where the session key came from (never the key), the pod, status, flags, time to
first byte, duration, bytes and attempts. Failed requests are logged even when the
successful ones are sampled away.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.conftest import eventually
from xds_server.envoy import names
from xds_server.envoy.access_log import FIELDS

BASE = "llama"
ADAPTER = "sql-lora"
SECRET_USER = "alice-the-session-key"


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_a_routed_request_logs_every_field(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, tmp_path
) -> None:
    log = tmp_path / "access.log"
    backend = await backends("llama-0")
    config_file.write(
        {"llama": ([BASE], [(backend, 1)])},
        adapters={"llama": [ADAPTER]},
        session_affinity=["llama"],
        flow_control={"enabled": True, "objectives": {"batch": -1}},
        listener={"access_log": {"path": str(log)}},
    )
    gateway = await gateway_factory()
    url = f"{gateway.url}/v1/chat/completions"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with http.post(url, json={"model": BASE, "user": SECRET_USER, **chat}) as response:
        assert response.status == 200
        request_id = response.headers.get("x-request-id")
        await response.read()
    async with http.post(
        url, json={"model": ADAPTER, **chat}, headers={names.OBJECTIVE_HEADER: "batch"}
    ) as response:
        assert response.status == 200
        await response.read()
    async with http.post(url, json={"model": "no-such-model", **chat}) as response:
        assert response.status == 404
        await response.read()

    lines = await eventually(
        lambda: len(_lines(log)) >= 3 and _lines(log), within_s=30, what="three log lines"
    )
    assert all(set(line) == set(FIELDS) for line in lines), lines
    keyed, adapter, refused = lines[:3]

    assert keyed["model"] == BASE
    assert keyed["pool"] == "llama"
    assert keyed["band"] == "standard"
    assert keyed["adapter"] is None
    assert keyed["session_key"] == "body"
    assert SECRET_USER not in json.dumps(lines)
    assert keyed["upstream_host"] == f"{backend.host}:{backend.port}"
    assert keyed["upstream_cluster"].startswith("llama/session")
    assert keyed["response_code"] == 200
    assert keyed["response_flags"] == "-"
    assert keyed["upstream_attempts"] == 1
    assert isinstance(keyed["ttfb_ms"], int) and isinstance(keyed["duration_ms"], int)
    assert 0 <= keyed["ttfb_ms"] <= keyed["duration_ms"]
    assert keyed["bytes_received"] > 0 and keyed["bytes_sent"] > 0
    assert keyed["method"] == "POST" and keyed["path"] == "/v1/chat/completions"
    if request_id is not None:
        assert keyed["request_id"] == request_id
    assert keyed["client"] == "127.0.0.1"

    assert adapter["model"] == ADAPTER
    assert adapter["adapter"] == ADAPTER
    assert adapter["band"] == "sheddable"
    assert adapter["session_key"] is None
    assert adapter["response_code"] == 200

    assert refused["model"] == "no-such-model"
    assert refused["response_code"] == 404
    assert refused["upstream_host"] is None
    assert refused["pool"] is None


async def test_sampling_keeps_every_failure(  # type: ignore[no-untyped-def]
    backends, config_file, gateway_factory, http, tmp_path
) -> None:
    log = tmp_path / "access.log"
    backend = await backends("llama-0")
    config_file.write(
        {"llama": ([BASE], [(backend, 1)])},
        listener={"access_log": {"path": str(log), "sample_percent": 0}},
    )
    gateway = await gateway_factory()
    url = f"{gateway.url}/v1/chat/completions"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for model in (BASE, BASE, "no-such-model", BASE):
        async with http.post(url, json={"model": model, **chat}) as response:
            await response.read()
    # The last request is logged after the ones before it: once it is there, none of the
    # successful ones came.
    async with http.get(f"{gateway.url}/v1/nothing-here") as response:
        assert response.status == 404
        await response.read()
    lines = await eventually(
        lambda: len(_lines(log)) >= 2 and _lines(log), within_s=30, what="the failures"
    )
    assert [(line["path"], line["response_code"]) for line in lines] == [
        ("/v1/chat/completions", 404),
        ("/v1/nothing-here", 404),
    ]
    assert backend.requests and len(backend.requests) == 3
