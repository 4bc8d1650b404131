"""OpenAI-style error bodies for the replies Envoy makes itself.

Clients of an OpenAI-compatible API parse `{"error": {...}}`; a plain-text reply from the
gateway would surface as an opaque decoding error in their SDKs. Envoy renders these with
`json_format`, which escapes substituted values (a model name with quotes stays valid
JSON) and sets `content-type: application/json`.
"""

from __future__ import annotations

from typing import Any as _Any

from envoy.config.core.v3 import substitution_format_string_pb2
from google.protobuf import struct_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.envoy import names

__all__ = ["error_format"]


def error_format(
    *, message: str, code: str, param: str | None = "model", error_type: str = names.ERROR_TYPE
) -> _Any:
    """A SubstitutionFormatString rendering OpenAI's error object.

    `message` may contain Envoy command operators (`%REQ(...)%`, `%DYNAMIC_METADATA(...)%`);
    a literal `%` must be written `%%`. `param=None` renders `"param": null`.
    """
    body = struct_pb2.Struct()
    error = body.get_or_create_struct("error")
    error["message"] = message
    error["type"] = error_type
    error["param"] = param  # None becomes JSON null
    error["code"] = code
    return substitution_format_string_pb2.SubstitutionFormatString(json_format=body)
