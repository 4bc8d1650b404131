"""The routes Envoy answers itself (routes.py's docstring, 0, 2' and 3-9): OpenAI-style
refusals, the model list and each model object, from the config alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any as _Any
from urllib.parse import quote

from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.type.matcher.v3 import string_pb2, value_pb2

from xds_server.apis import paths_of
from xds_server.config import RoutingConfig
from xds_server.envoy import _error_bodies, names
from xds_server.envoy._route_matches import (
    READ,
    forwarded,
    group_name,
    path_match,
    string,
)
from xds_server.envoy._route_to_pools import split_pools

__all__ = [
    "MAX_ECHOED_MODEL_CHARS",
    "MAX_ECHOED_PATH_CHARS",
    "MODELS_PATH",
    "MODEL_CREATED",
    "direct_response_bytes",
    "forwarded_paths",
    "model_paths",
    "model_refusals",
    "not_found",
    "unserved_paths",
    "wrong_methods",
]

_FORWARDED_METHOD = "POST"

# Answered by Envoy from the config: the model list, and `MODELS_PATH/<id>` (GET only).
MODELS_PATH = "/v1/models"
_MODELS_METHOD = "GET"

# The `created` of every model object: fixed, so that the route config's content hash
# (its version) is the same on every server replica and after every restart.
MODEL_CREATED = 0

# Refusals of a path echo the method and the path, truncated like model names.
MAX_ECHOED_PATH_CHARS = 256
_MAX_ECHOED_METHOD_CHARS = 32

# RFC 3986 `pchar` besides the unreserved characters, which quote() never encodes: what
# a path segment may carry unencoded (the OpenAI SDK encodes model ids this way).
_PCHAR_SAFE = "!$&'()*+,;=:@"

# Envoy's limit on a direct response's `body` when the route config sets none.
_DEFAULT_DIRECT_RESPONSE_BYTES = 4096

# Error messages echo the requested model, truncated to this many characters so a huge
# `model` value does not come back in full (the formatter's `:N` suffix).
MAX_ECHOED_MODEL_CHARS = 256

# The request's method and path in a refusal's message (escaped by json_format).
_ECHOED_METHOD = f"%REQ(:METHOD):{_MAX_ECHOED_METHOD_CHARS}%"
_ECHOED_PATH = f"%REQ(:PATH):{MAX_ECHOED_PATH_CHARS}%"


# The model a refusal names: the body's, or the model header's (`%REQ(<header>)%`).
_ECHOED_BODY_MODEL = (
    f"%DYNAMIC_METADATA({names.METADATA_NAMESPACE}:{names.MODEL_KEY}):{MAX_ECHOED_MODEL_CHARS}%"
)


def _echoed_header(header: str) -> str:
    return f"%REQ({header}):{MAX_ECHOED_MODEL_CHARS}%"


def forwarded_paths(config: RoutingConfig) -> tuple[str, ...]:
    """Every path some pool serves (apis.paths_of the pools' `api`), in apis.API_PATHS's
    order: the paths routes 0 and 3-7 take."""
    return paths_of(tuple({api for pool in config.pools for api in pool.api}))


def wrong_methods(paths: Sequence[str]) -> list[_Any]:
    """Route 0: 405 for a forwarded path (`paths`) with any method but POST."""
    return [_other_methods(path, _FORWARDED_METHOD) for path in paths]


def unserved_paths(config: RoutingConfig, header: str) -> Iterator[_Any]:
    """Routes 2' (routes.py's docstring): 404 for a served model named on a forwarded path
    its pool (or its split's pools) does not serve, by the body (one route per pool or
    split, its names in an or_match) and by the `header` (one per name)."""
    everything = forwarded_paths(config)
    rewritten = {r.model for r in config.model_rewrites}
    owners = [
        (
            f"pool/{pool.name}",
            [m for m in (*pool.models, *pool.adapters) if m not in rewritten],
            paths_of(pool.api),
        )
        for pool in config.pools
    ]
    owners += [
        (f"split/{r.model}", [r.model], paths_of(config.rewrite_api(r)))
        for r in config.model_rewrites
    ]
    for owner, models, served in owners:
        unserved = [path for path in everything if path not in served]
        if not unserved or not models:
            continue
        yield from _unserved(
            f"error/unserved_path/{owner}",
            forwarded(unserved, metadata=_any_of(models)),
            _ECHOED_BODY_MODEL,
        )
        for model in models:
            by_header = rc_pb2.HeaderMatcher(
                name=header, string_match=string_pb2.StringMatcher(exact=model)
            )
            matches = forwarded(
                unserved, metadata=string(exact=names.MODEL_MISSING), headers=[by_header]
            )
            yield from _unserved(
                f"error/unserved_path/header/{model}", matches, _echoed_header(header)
            )


def _any_of(models: Sequence[str]) -> _Any:
    """A ValueMatcher for a string equal to one of `models`."""
    if len(models) == 1:
        return string(exact=models[0])
    return value_pb2.ValueMatcher(
        or_match=value_pb2.OrMatcher(value_matchers=[string(exact=m) for m in models])
    )


def _unserved(name: str, matches: Sequence[_Any], echoed_model: str) -> Iterator[_Any]:
    for index, match in enumerate(matches):
        yield _refusal(
            name=group_name(name, index),
            match=match,
            status=404,
            message=(
                f"Invalid URL ({_ECHOED_METHOD} {_ECHOED_PATH}): the model `{echoed_model}` "
                "is not served on this path."
            ),
            code="not_found",
            param=None,
        )


def model_refusals(header: str, paths: Sequence[str]) -> list[_Any]:
    """Routes 3-7: the refusals of a request on a forwarded path (`paths`) whose model no
    route above took, `header` being the listener's model header."""
    refusals = [
        (
            "error/unknown_header_model",
            forwarded(
                paths,
                metadata=string(exact=names.MODEL_MISSING),
                headers=[rc_pb2.HeaderMatcher(name=header, present_match=True)],
            ),
            404,
            f"The model `{_echoed_header(header)}` does not exist.",
            "model_not_found",
        ),
        (
            "error/missing_model",
            forwarded(paths, metadata=string(exact=names.MODEL_MISSING)),
            400,
            (
                "You must provide a model parameter: `model` in the JSON body, "
                f"or the {header} header."
            ),
            "missing_model",
        ),
        (
            "error/invalid_body",
            forwarded(paths, metadata=string(exact=names.MODEL_INVALID)),
            400,
            "The request body is not valid JSON, or its content-type is not JSON.",
            "invalid_json",
        ),
        (
            "error/unknown_model",
            forwarded(paths, metadata=string(regex=r"(?s).*")),
            404,
            f"The model `{_ECHOED_BODY_MODEL}` does not exist.",
            "model_not_found",
        ),
        (
            "error/model_not_string",
            forwarded(paths, metadata=value_pb2.ValueMatcher(present_match=True)),
            400,
            "`model` must be a string.",
            "invalid_type",
        ),
    ]
    return [
        _refusal(
            name=group_name(name, index), match=match, status=status, message=message, code=code
        )
        for name, matches, status, message, code in refusals
        for index, match in enumerate(matches)
    ]


def model_paths(config: RoutingConfig) -> list[_Any]:
    """Routes 8a-8d: the model list and each model object, the 404 of an unknown model id,
    and the 405s of other methods."""
    objects = _model_objects(config)
    routes = [
        _document(
            "models/list",
            path_match(path=MODELS_PATH, method=_MODELS_METHOD),
            {"object": "list", "data": list(objects.values())},
        )
    ]
    for model, document in objects.items():
        segments = {quote(model, safe=_PCHAR_SAFE), quote(model, safe=_PCHAR_SAFE + "/")}
        for segment in sorted(segments):
            path = f"{MODELS_PATH}/{segment}"
            match = path_match(path=path, method=_MODELS_METHOD)
            routes.append(_document(f"models/retrieve/{segment}", match, document))
    routes.append(
        _refusal(
            name="error/unknown_model_id",
            match=path_match(prefix=MODELS_PATH + "/", method=_MODELS_METHOD),
            status=404,
            message=f"The model requested by `{_ECHOED_METHOD} {_ECHOED_PATH}` does not exist.",
            code="model_not_found",
        )
    )
    # GET is taken above: any other method.
    routes.append(_method_not_allowed(MODELS_PATH, path_match(path=MODELS_PATH), _MODELS_METHOD))
    under = MODELS_PATH + "/"
    routes.append(_method_not_allowed(under, path_match(prefix=under), _MODELS_METHOD))
    return routes


def not_found() -> _Any:
    """Route 9: 404 for any other path, echoing the method and the path."""
    return _refusal(
        name="error/not_found",
        match=rc_pb2.RouteMatch(prefix="/", dynamic_metadata=[READ]),
        status=404,
        message=f"Invalid URL ({_ECHOED_METHOD} {_ECHOED_PATH}).",
        code="not_found",
        param=None,
    )


def direct_response_bytes(routes: Iterable[_Any]) -> int:
    """The route config's `max_direct_response_body_size_bytes` for `routes`: Envoy's
    default, or the largest literal body (the model list grows with the models)."""
    return max(_DEFAULT_DIRECT_RESPONSE_BYTES, *map(_body_bytes, routes))


def _model_objects(config: RoutingConfig) -> dict[str, dict[str, _Any]]:
    """OpenAI's model object of every model a request can name, by id, sorted by id
    (routes.py's docstring)."""

    def model(model_id: str, owned_by: str, parent: str | None = None) -> dict[str, _Any]:
        document: dict[str, _Any] = {
            "id": model_id,
            "object": "model",
            "created": MODEL_CREATED,
            "owned_by": owned_by,
        }
        if parent is not None:
            document["parent"] = parent
        return document

    objects = {}
    for pool in config.pools:
        for name in pool.models:
            objects[name] = model(name, pool.name)
        for adapter in pool.adapters:
            objects[adapter] = model(adapter, pool.name, parent=pool.models[0])
    # A rewritten name is served by its split, even when a pool lists it too.
    for rewrite in config.model_rewrites:
        objects[rewrite.model] = model(rewrite.model, " or ".join(split_pools(config, rewrite)))
    return dict(sorted(objects.items()))


def _document(name: str, match: _Any, document: Mapping[str, _Any]) -> _Any:
    """A 200 direct response with `document` as its JSON body.

    The JSON is rendered here, once, and sent as the literal `body`, which Envoy does not
    format (a text format would read the `%` of `50%-model` as an operator); the body
    format only wraps it, to set the content type.
    """
    text = json.dumps(document, separators=(",", ":"))
    return rc_pb2.Route(
        name=name,
        match=match,
        direct_response=rc_pb2.DirectResponseAction(
            status=200,
            body=base_pb2.DataSource(inline_string=text),
            body_format=substitution_format_string_pb2.SubstitutionFormatString(
                text_format_source=base_pb2.DataSource(inline_string="%LOCAL_REPLY_BODY%"),
                content_type="application/json",
            ),
        ),
    )


def _body_bytes(route: _Any) -> int:
    """The size of `route`'s literal direct response body (0 for any other route)."""
    return len(route.direct_response.body.inline_string.encode())


def _other_methods(path: str, allowed: str) -> _Any:
    """405 for the requests on exactly `path` with any method but `allowed`."""
    match = path_match(path=path, method=allowed, invert_method=True)
    return _method_not_allowed(path, match, allowed)


def _method_not_allowed(path: str, match: _Any, allowed: str) -> _Any:
    """405 with `allow: <allowed>` (RFC 9110 15.5.6) for the requests of `match` (on
    `path`, which names the route)."""
    route = _refusal(
        name=f"error/method_not_allowed{path}",
        match=match,
        status=405,
        message=f"The method {_ECHOED_METHOD} is not allowed on `{_ECHOED_PATH}`; use {allowed}.",
        code="method_not_allowed",
        param=None,
    )
    route.response_headers_to_add.append(
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="allow", value=allowed),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )
    return route


def _refusal(
    *, name: str, match: _Any, status: int, message: str, code: str, param: str | None = "model"
) -> _Any:
    body = _error_bodies.error_format(message=message, code=code, param=param)
    return rc_pb2.Route(
        name=name,
        match=match,
        direct_response=rc_pb2.DirectResponseAction(status=status, body_format=body),
    )
