"""The request access log the listener gets (envoy/access_log.py), built without Envoy;
tests/e2e/test_access_log.py reads the lines a real Envoy writes."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from google.protobuf import json_format

from tests.envoy.static_bootstrap import hcm_of
from xds_server.config import ConfigError, RoutingConfig, parse_config
from xds_server.envoy import build_listeners, names
from xds_server.envoy.access_log import FIELDS, FILE_ACCESS_LOG, SAMPLE_RUNTIME_KEY
from xds_server.envoy.routes import build_routes

YAML = """
listener: {address: 127.0.0.1, port: 8080%s}
pools:
  - name: p
    models: [m]
    adapters: [lora-a]
    session_affinity: true
    endpoints: [{address: 10.0.0.1, port: 8000}]
"""


def _config(listener: str = "") -> RoutingConfig:
    return parse_config(YAML % listener)


def _log(config: RoutingConfig) -> tuple[Any, Any]:
    (log,) = hcm_of(build_listeners(config)[0]).access_log
    assert log.name == FILE_ACCESS_LOG
    logger = file_pb2.FileAccessLog()
    assert log.typed_config.Unpack(logger)
    return log, logger


def test_every_request_is_one_json_line_on_standard_output() -> None:
    log, logger = _log(_config())
    assert logger.path == "/dev/stdout"
    assert json_format.MessageToDict(logger.log_format.json_format) == FIELDS
    # Not sampled: no filter at all.
    assert not log.HasField("filter")


def test_the_log_never_prints_a_session_key() -> None:
    printed = " ".join(FIELDS.values())
    assert names.SESSION_KEY not in printed.replace(names.SESSION_SOURCE_KEY, "")
    assert names.SESSION_HEADER not in printed.lower()
    assert "prompt" not in printed.lower()


def test_sampling_keeps_failures_and_draws_the_rest() -> None:
    log, logger = _log(_config(", access_log: {sample_percent: 12.5, path: /var/log/gw.log}"))
    assert logger.path == "/var/log/gw.log"
    either = log.filter.or_filter.filters
    status, flags, sampled = either
    assert status.status_code_filter.comparison.op == accesslog_pb2.ComparisonFilter.GE
    assert status.status_code_filter.comparison.value.default_value == 400
    # No flag listed: any response flag.
    assert list(flags.response_flag_filter.flags) == []
    assert sampled.runtime_filter.runtime_key == SAMPLE_RUNTIME_KEY
    assert sampled.runtime_filter.percent_sampled.numerator == 125_000
    assert sampled.runtime_filter.use_independent_randomness


def test_the_log_can_be_turned_off() -> None:
    hcm = hcm_of(build_listeners(_config(", access_log: {enabled: false}"))[0])
    assert list(hcm.access_log) == []


def test_the_spill_listener_does_not_log_the_hop_again() -> None:
    config = _config()
    spill = [lst for lst in build_listeners(config) if lst.name != names.LISTENER_NAME]
    assert spill, "the session pool has a spill listener"
    assert all(list(hcm_of(lst).access_log) == [] for lst in spill)


def test_routes_carry_pool_adapter_and_where_the_session_key_came_from() -> None:
    routes = build_routes(_config())[0].virtual_hosts[0].routes
    metadata = {
        r.name: json_format.MessageToDict(r.metadata.filter_metadata[names.METADATA_NAMESPACE])
        for r in routes
        if r.HasField("metadata")
    }
    kind = "model"
    assert metadata[f"{kind}/m"] == {"pool": "p"}
    assert metadata[f"{kind}/lora-a"] == {"pool": "p", "adapter": "lora-a"}
    assert metadata[f"session-{kind}/m"] == {"pool": "p", "session_key_from": "header"}
    assert metadata[f"session-key-{kind}/lora-a"] == {
        "pool": "p",
        "adapter": "lora-a",
        "session_key_from": "body",
    }


def test_a_path_outside_the_pattern_is_refused() -> None:
    with pytest.raises(ConfigError, match="access_log"):
        _config(", access_log: {path: relative.log}")
