"""The route matchers of routes.py: which requests a route takes.

Every route but the last waits for json_to_metadata (listeners.py) to have read the request
(`llm:model` present, any value); the model routes (1-7 of routes.py's docstring) take the
forwarded paths only, exactly: a pool's own paths (apis.paths_of its `api`) for its
models, every pool's paths for the refusals.

Paths are matched as one RE2 alternation of the exact paths, or `path` when there is only
one. Envoy refuses a regex whose RE2 program is larger than 100
(`re2.max_program_size.error_level`), and every API's paths together make 122; a literal
alternation's program is at most its length plus 4 (measured on Envoy 1.40: 34 for the two
completions paths, 36 characters), so the paths are cut into alternations of at most
MAX_ALTERNATION_CHARS characters, one route each. Three or four APIs fit in one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any as _Any

from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2, value_pb2

from xds_server.envoy import names

__all__ = [
    "MAX_ALTERNATION_CHARS",
    "READ",
    "by_model",
    "forwarded",
    "group_name",
    "metadata_matcher",
    "path_groups",
    "path_match",
    "string",
    "with_header",
    "with_metadata",
]

# The longest path alternation in one route (module docstring: RE2's program size).
MAX_ALTERNATION_CHARS = 90


@functools.cache
def path_groups(paths: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """`paths` cut, in order, into groups whose alternation is at most MAX_ALTERNATION_CHARS
    long (a path longer than that alone); cached, as many pools share one list."""
    groups: list[list[str]] = []
    length = 0
    for path in paths:
        added = len(re.escape(path))
        if groups and length + 1 + added <= MAX_ALTERNATION_CHARS:
            groups[-1].append(path)
            length += 1 + added
        else:
            groups.append([path])
            length = added
    return tuple(tuple(group) for group in groups)


def forwarded(
    paths: Sequence[str], *, metadata: _Any | None = None, headers: list[_Any] | None = None
) -> list[_Any]:
    """The matches of `paths` (one per path_groups group); `metadata` is a ValueMatcher
    applied to `llm:model`, `headers` HeaderMatchers each match also asks for."""
    matches = []
    for group in path_groups(tuple(paths)):
        match = rc_pb2.RouteMatch(headers=headers or [])
        if len(group) == 1:
            match.path = group[0]
        else:
            match.safe_regex.regex = "|".join(re.escape(path) for path in group)
        if metadata is not None:
            match.dynamic_metadata.append(metadata_matcher(names.MODEL_KEY, metadata))
        matches.append(match)
    return matches


def group_name(name: str, index: int) -> str:
    """The name of the route of path group `index` (forwarded): `name` for the first,
    `name#<n>` for the n-th after it."""
    return name if index == 0 else f"{name}#{index + 1}"


def by_model(header: str, model: str, *, kind: str, paths: Sequence[str]) -> list[_Any]:
    """The matches on `paths` of route kind `model` (the body names `model`) or `header`
    (only the header does)."""
    if kind == "model":
        return forwarded(paths, metadata=string(exact=model))
    exact = string_pb2.StringMatcher(exact=model)
    by_header = rc_pb2.HeaderMatcher(name=header, string_match=exact)
    return forwarded(paths, metadata=string(exact=names.MODEL_MISSING), headers=[by_header])


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
