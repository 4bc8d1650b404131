"""The listener filter that writes each keyed request's key bucket (`key_homes: buckets`).

Envoy has no filter that hashes a header into metadata, but its generic matcher has an
input matcher that hashes: `envoy.matching.input_matchers.consistent_hashing` is true when
`xxHash64(input, seed) % modulo >= threshold`, the hash Envoy's header hash policy takes
and the server takes of every logged key (xds/session_keys.py). A composite filter's
matcher tree of them, one threshold per level, halves the buckets at each level (eight
levels for 256) and runs, at its leaf, a `set_metadata` filter that writes
`envoy.lb: {key_bucket: "<b>"}`. The router merges the request's `envoy.lb` dynamic
metadata into the subset criteria, so a bucketed session cluster (clusters.py) sends the
request to the endpoint that lists its bucket (endpoints.py). The tree's root matches only
when the session header is there (a threshold of 0: any hash), so an unkeyed request gets
no bucket. It is static: it changes with `key_buckets` only, never with the table.

Verified on Envoy 1.40 (bench/results/bucket-homes/probe.py): 400 keys of 400 reached the
endpoint listing their bucket.
"""

from __future__ import annotations

from typing import Any as _Any

from envoy.config.core.v3 import extension_pb2
from envoy.extensions.common.matching.v3 import extension_matcher_pb2
from envoy.extensions.filters.http.composite.v3 import composite_pb2
from envoy.extensions.filters.http.set_metadata.v3 import set_metadata_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.matching.input_matchers.consistent_hashing.v3 import (
    consistent_hashing_pb2,
)
from envoy.type.matcher.v3 import http_inputs_pb2
from google.protobuf import struct_pb2  # type: ignore[import-untyped, unused-ignore]
from xds.core.v3 import extension_pb2 as xds_extension_pb2
from xds.type.matcher.v3 import matcher_pb2

from xds_server.envoy import _protos, names

__all__ = ["KEY_BUCKET_FILTER", "key_bucket_filter"]

KEY_BUCKET_FILTER = "llm.key_bucket"
_COMPOSITE = "envoy.filters.http.composite"
_SET_METADATA = "envoy.filters.http.set_metadata"


def key_bucket_filter(buckets: int) -> _Any:
    """The HCM filter writing the bucket of the request's session header, of `buckets`."""
    matcher = matcher_pb2.Matcher(
        matcher_list=matcher_pb2.Matcher.MatcherList(
            matchers=[
                matcher_pb2.Matcher.MatcherList.FieldMatcher(
                    predicate=_hash_at_least(0, buckets),
                    on_match=_tree(0, buckets, buckets),
                )
            ]
        )
    )
    return hcm_pb2.HttpFilter(
        name=KEY_BUCKET_FILTER,
        typed_config=_protos.pack(
            extension_matcher_pb2.ExtensionWithMatcher(
                extension_config=_typed(_COMPOSITE, composite_pb2.Composite()),
                xds_matcher=matcher,
            )
        ),
    )


def _typed(name: str, message: _Any) -> _Any:
    return extension_pb2.TypedExtensionConfig(name=name, typed_config=_protos.pack(message))


def _xds_typed(name: str, message: _Any) -> _Any:
    return xds_extension_pb2.TypedExtensionConfig(name=name, typed_config=_protos.pack(message))


def _hash_at_least(threshold: int, buckets: int) -> _Any:
    """True when the session header is there and its hash % `buckets` >= `threshold`."""
    return matcher_pb2.Matcher.MatcherList.Predicate(
        single_predicate=matcher_pb2.Matcher.MatcherList.Predicate.SinglePredicate(
            input=_xds_typed(
                "session-key",
                http_inputs_pb2.HttpRequestHeaderMatchInput(header_name=names.SESSION_HEADER),
            ),
            custom_match=_xds_typed(
                "key-bucket",
                consistent_hashing_pb2.ConsistentHashing(
                    threshold=threshold, modulo=buckets, seed=0
                ),
            ),
        )
    )


def _tree(low: int, high: int, buckets: int) -> _Any:
    """The action for buckets `low` .. `high - 1`: at a leaf, write the bucket; else split
    at the middle."""
    if high - low == 1:
        return matcher_pb2.Matcher.OnMatch(action=_write_bucket(low))
    middle = (low + high) // 2
    return matcher_pb2.Matcher.OnMatch(
        matcher=matcher_pb2.Matcher(
            matcher_list=matcher_pb2.Matcher.MatcherList(
                matchers=[
                    matcher_pb2.Matcher.MatcherList.FieldMatcher(
                        predicate=_hash_at_least(middle, buckets),
                        on_match=_tree(middle, high, buckets),
                    )
                ]
            ),
            on_no_match=_tree(low, middle, buckets),
        )
    )


def _write_bucket(bucket: int) -> _Any:
    value = struct_pb2.Struct()
    value.update({names.KEY_BUCKET_KEY: str(bucket)})
    return _xds_typed(
        f"bucket-{bucket}",
        composite_pb2.ExecuteFilterAction(
            typed_config=_typed(
                _SET_METADATA,
                set_metadata_pb2.Config(
                    metadata=[
                        set_metadata_pb2.Metadata(
                            metadata_namespace=names.LB_METADATA_NAMESPACE, value=value
                        )
                    ]
                ),
            )
        ),
    )
