"""The request access log: one JSON line per request, written by Envoy itself.

Each line says which model, adapter, band and pool a request got, whether it carried a
session key (its source, never the key), which pod served it, with the status, Envoy's
response flags, time to first byte, duration, bytes and upstream attempts (FIELDS). The
pool, band, adapter and key source are route metadata (routes.py, `route_metadata`), so
the log costs no filter and nothing per request beyond the line; the model is the one
json_to_metadata read from the body.

Envoy's file logger writes through its own flush thread (`listener.access_log.path`,
standard output by default, as a container's log wants). `sample_percent` below 100 keeps
that share of the requests that succeeded; a request that failed or was refused (status
400 and up, or any response flag) is always logged: those are the lines an operator looks
for.
"""

from __future__ import annotations

from typing import Any as _Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import struct_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.config import AccessLogConfig
from xds_server.envoy import _protos, names

__all__ = ["FIELDS", "FILE_ACCESS_LOG", "SAMPLE_RUNTIME_KEY", "TENANT_FIELD", "request_log"]

FILE_ACCESS_LOG = "envoy.access_loggers.file"
# Overrides `sample_percent` at run time, in parts per million (Envoy reads it as the
# sampled numerator; the admin layer: `POST /runtime_modify`).
SAMPLE_RUNTIME_KEY = "llm.access_log.sample"
# The tenant, when a header names it (request_log).
TENANT_FIELD = "tenant"


def _route(key: str) -> str:
    return f"%METADATA(ROUTE:{names.METADATA_NAMESPACE}:{key})%"


# Field -> Envoy command. A value Envoy does not have (no pod was tried, no band without
# flow control) is JSON null; numbers stay numbers.
FIELDS: dict[str, str] = {
    "start_time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "model": f"%DYNAMIC_METADATA({names.METADATA_NAMESPACE}:{names.MODEL_KEY})%",
    "adapter": _route(names.ADAPTER_KEY),
    "band": _route(names.BAND_KEY),
    "pool": _route(names.POOL_KEY),
    "session_key": _route(names.SESSION_SOURCE_KEY),
    "route": "%ROUTE_NAME%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    "upstream_attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "response_code": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "response_code_details": "%RESPONSE_CODE_DETAILS%",
    "ttfb_ms": "%RESPONSE_DURATION%",
    "duration_ms": "%DURATION%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "client": "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%",
}


def request_log(config: AccessLogConfig, tenant: str | None = None) -> _Any:
    """The listener's access log of `config` (module docstring); with `tenant`, the command
    operator printing a request's tenant (_tenant_limits.tenant_format), also that: a
    tenant's refusals (429, flag RL) are counted from the log."""
    line = struct_pb2.Struct()
    line.update(FIELDS)
    if tenant is not None:
        line.update({TENANT_FIELD: tenant})
    logger = file_pb2.FileAccessLog(
        path=config.path,
        log_format=substitution_format_string_pb2.SubstitutionFormatString(json_format=line),
    )
    log = accesslog_pb2.AccessLog(name=FILE_ACCESS_LOG, typed_config=_protos.pack(logger))
    if config.sample_percent < 100:
        log.filter.CopyFrom(_failed_or_sampled(config.sample_percent))
    return log


def _failed_or_sampled(percent: float) -> _Any:
    """Every request with a status of 400 and up or a response flag, and `percent` of the
    rest, drawn per request."""
    flt = accesslog_pb2.AccessLogFilter
    failed = flt(
        status_code_filter=accesslog_pb2.StatusCodeFilter(
            comparison=accesslog_pb2.ComparisonFilter(
                op=accesslog_pb2.ComparisonFilter.GE,
                value=base_pb2.RuntimeUInt32(
                    default_value=400, runtime_key="llm.access_log.min_failed_status"
                ),
            )
        )
    )
    flagged = flt(response_flag_filter=accesslog_pb2.ResponseFlagFilter())
    sampled = flt(
        runtime_filter=accesslog_pb2.RuntimeFilter(
            runtime_key=SAMPLE_RUNTIME_KEY,
            percent_sampled=percent_pb2.FractionalPercent(
                numerator=round(percent * 10_000),
                denominator=percent_pb2.FractionalPercent.MILLION,
            ),
            use_independent_randomness=True,
        )
    )
    return flt(or_filter=accesslog_pb2.OrFilter(filters=[failed, flagged, sampled]))
