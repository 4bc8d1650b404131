"""The route matchers of routes.py: which requests a route takes.

Every route but the last waits for json_to_metadata (listeners.py) to have read the request
(`llm:model` present, any value); the model routes (1-7 of routes.py's docstring) take the
forwarded paths only, by one RE2 alternation of the exact paths.
"""

from __future__ import annotations

import re
from typing import Any as _Any

from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2, value_pb2

from xds_server.envoy import names

__all__ = [
    "FORWARDED_PATHS",
    "READ",
    "by_model",
    "forwarded",
    "metadata_matcher",
    "path_match",
    "string",
    "with_header",
    "with_metadata",
]

# The allow-list: the only paths a request reaches a model server on, each POST only,
# matched exactly (routes.py's docstring). Another OpenAI path (`/v1/embeddings`,
# `/v1/responses`) is served once it is added here.
FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions")

# Routes 1-7 (routes.py's docstring): the forwarded paths, exactly, as one RE2 alternation.
_FORWARDED_REGEX = "|".join(re.escape(path) for path in FORWARDED_PATHS)


def forwarded(*, metadata: _Any | None = None, headers: list[_Any] | None = None) -> _Any:
    """A forwarded path (FORWARDED_PATHS); `metadata` is a ValueMatcher applied to
    `llm:model`."""
    match = rc_pb2.RouteMatch(
        safe_regex=regex_pb2.RegexMatcher(regex=_FORWARDED_REGEX), headers=headers or []
    )
    if metadata is not None:
        match.dynamic_metadata.append(metadata_matcher(names.MODEL_KEY, metadata))
    return match


def by_model(header: str, model: str, *, kind: str) -> _Any:
    """Route kind `model` (the body names `model`) or `header` (only the header does)."""
    if kind == "model":
        return forwarded(metadata=string(exact=model))
    return _by_header(header, model)


def _by_header(header: str, model: str) -> _Any:
    """Requests without a body `model` whose `header` names `model`."""
    exact = string_pb2.StringMatcher(exact=model)
    by_header = rc_pb2.HeaderMatcher(name=header, string_match=exact)
    return forwarded(metadata=string(exact=names.MODEL_MISSING), headers=[by_header])


def with_header(match: _Any, header: _Any) -> _Any:
    """A copy of `match` that also asks for `header` (a HeaderMatcher)."""
    narrowed = rc_pb2.RouteMatch()
    narrowed.CopyFrom(match)
    narrowed.headers.append(header)
    return narrowed


def with_metadata(match: _Any, metadata: _Any) -> _Any:
    """A copy of `match` that also asks for `metadata` (a MetadataMatcher)."""
    narrowed = rc_pb2.RouteMatch()
    narrowed.CopyFrom(match)
    narrowed.dynamic_metadata.append(metadata)
    return narrowed


def path_match(
    *,
    path: str | None = None,
    prefix: str | None = None,
    method: str | None = None,
    invert_method: bool = False,
) -> _Any:
    """The requests for exactly `path` (or any path under `prefix`), with `method` (any
    other method when `invert_method`), once json_to_metadata has read them."""
    match = rc_pb2.RouteMatch(dynamic_metadata=[READ])
    if path is not None:
        match.path = path
    else:
        match.prefix = prefix or "/"
    if method is not None:
        match.headers.append(
            rc_pb2.HeaderMatcher(
                name=":method",
                string_match=string_pb2.StringMatcher(exact=method),
                invert_match=invert_method,
            )
        )
    return match


def metadata_matcher(key: str, value: _Any) -> _Any:
    """`value` (a ValueMatcher) applied to dynamic metadata `llm:<key>`."""
    return metadata_pb2.MetadataMatcher(
        filter=names.METADATA_NAMESPACE,
        path=[metadata_pb2.MetadataMatcher.PathSegment(key=key)],
        value=value,
    )


def string(*, exact: str | None = None, regex: str | None = None) -> _Any:
    """A ValueMatcher for a string value, equal to `exact` or fully matching `regex`."""
    if regex is not None:
        matcher = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=regex))
    else:
        matcher = string_pb2.StringMatcher(exact=exact)
    return value_pb2.ValueMatcher(string_match=matcher)


# Route matcher: json_to_metadata has read the request (it always writes `llm:model`).
READ = metadata_matcher(names.MODEL_KEY, value_pb2.ValueMatcher(present_match=True))
