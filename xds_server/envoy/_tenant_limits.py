"""Each tenant's request rate limit, enforced by Envoy's local rate limit filter (no callout).

The listener runs `envoy.filters.http.local_ratelimit` with no token bucket of its own
(disabled): first when a header names the tenant (a refused request's body is never
buffered), after json_to_metadata when a body field does (it writes `llm:tenant`). Its
real configuration comes with the routes (RDS), on the virtual host
(`typed_per_filter_config`), so a changed limit reaches Envoy without a listener update
(which would drain connections); every route inherits it. That configuration:

- makes one descriptor of each request, `tenant=<the tenant header or llm:tenant>` (none
  without it: such a request is not limited);
- gives each named tenant with a `requests_per_s` a token bucket (`tenant_bucket`); a
  tenant not listed matches no descriptor and falls to the default bucket, which never
  runs dry (`UNLIMITED`) and is not consumed by a request a descriptor took
  (`always_consume_default_token_bucket` false);
- counts per Envoy, not per connection (`local_rate_limit_per_downstream_connection`
  false); answers 429 (not gRPC's RESOURCE_EXHAUSTED: `rate_limited_as_resource_exhausted`
  false), with the draft RFC's `x-ratelimit-limit` / `-remaining` / `-reset` headers; a
  mapper per tenant (listeners.py) gives it a JSON body naming the tenant and its limit,
  and Retry-After (`retry_after_s`).

A tenant's `requests_per_s` is the fleet's: each Envoy's bucket holds an even part of it,
rate / N over the N Envoys flow control's load knows (snapshot_builder.tenant_envoys; 1
without flow control). A token bucket's fields are not runtime keys, so the parts ride on
the routes (an RDS push when N changes, which drains nothing), and with them each tenant's
Retry-After, in the virtual host's metadata (METADATA_NAMESPACE). Envoy builds the
per-route configuration anew on every RDS update, so each route push refills every
bucket: one more burst per push in the error bound (docs/flow-control.md, "Tenants").

Verified on Envoy 1.40 (tests/e2e/test_tenant_limits.py; docs/flow-control.md, "Tenants").
"""

from __future__ import annotations

import math
from typing import Any as _Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2, value_pb2
from envoy.type.metadata.v3 import metadata_pb2 as metadata_key_pb2
from envoy.type.v3 import percent_pb2, token_bucket_pb2
from google.protobuf import wrappers_pb2  # type: ignore[import-untyped, unused-ignore]

from xds_server.config import TenantsConfig
from xds_server.envoy import _protos, names

__all__ = [
    "DESCRIPTOR_KEY",
    "LOCAL_RATE_LIMIT_FILTER",
    "METADATA_NAMESPACE",
    "STAT_PREFIX",
    "TENANT_KEY",
    "UNLIMITED",
    "configure_virtual_host",
    "is_tenant",
    "listener_filter",
    "retry_after_format",
    "retry_after_s",
    "tenant_bucket",
    "tenant_format",
]

LOCAL_RATE_LIMIT_FILTER = "envoy.filters.http.local_ratelimit"
# Envoy's counters: <STAT_PREFIX>.http_local_rate_limit.{enabled,enforced,rate_limited,ok}.
STAT_PREFIX = "tenant_rate_limit"
DESCRIPTOR_KEY = "tenant"
# Where json_to_metadata writes a body field's tenant: `llm:tenant`.
TENANT_KEY = "tenant"
# The virtual host's metadata: each limited tenant's Retry-After, by tenant name.
METADATA_NAMESPACE = "llm.tenant_retry_after"
# The default bucket's size and refill per second: more than one Envoy can take.
UNLIMITED = 1_000_000_000
# Envoy's smallest fill interval for a local rate limit's token bucket.
_MIN_FILL_S = 0.05


def tenant_bucket(requests_per_s: float) -> _Any:
    """A token bucket that admits `requests_per_s` on average, and a burst of one second's
    requests (at least one). Tokens come in whole numbers: `tokens_per_fill` whole tokens
    every `tokens_per_fill / requests_per_s` seconds (at least 50 ms, Envoy's floor)."""
    tokens, fill_s = _refill(requests_per_s)
    return token_bucket_pb2.TokenBucket(
        max_tokens=max(tokens, math.ceil(requests_per_s)),
        tokens_per_fill=_protos.uint32(tokens),
        fill_interval=_protos.duration(fill_s),
    )


def retry_after_s(requests_per_s: float) -> int:
    """The whole seconds a refused request of a tenant waits: one refill of its bucket."""
    return max(1, math.ceil(round(_refill(requests_per_s)[1], 6)))


def _refill(requests_per_s: float) -> tuple[int, float]:
    """The tokens of one refill, and the seconds between refills."""
    tokens = max(1, round(requests_per_s), math.ceil(requests_per_s * _MIN_FILL_S))
    return tokens, tokens / requests_per_s


def listener_filter() -> _Any:
    """The filter in the listener's chain: disabled until a route (the virtual host)
    configures it."""
    return local_rate_limit_pb2.LocalRateLimit(stat_prefix=STAT_PREFIX)


def configure_virtual_host(virtual_host: _Any, tenants: TenantsConfig, envoys: int = 1) -> None:
    """Give `virtual_host` the filter's configuration, each limited tenant's `requests_per_s`
    split evenly over `envoys` Envoys, and in its metadata (METADATA_NAMESPACE) each
    tenant's Retry-After, the seconds of one refill of its bucket, which the tenant's 429
    reads (listeners.py). Nothing when no tenant has a rate limit."""
    limits = tenants.rate_limited()
    if not limits or not tenants.named_by():
        return
    shares = {tenant: rate / max(1, envoys) for tenant, rate in limits.items()}
    always = percent_pb2.FractionalPercent(
        numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED
    )
    config = local_rate_limit_pb2.LocalRateLimit(
        stat_prefix=STAT_PREFIX,
        token_bucket=token_bucket_pb2.TokenBucket(
            max_tokens=UNLIMITED,
            tokens_per_fill=_protos.uint32(UNLIMITED),
            fill_interval=_protos.duration(1),
        ),
        filter_enabled=base_pb2.RuntimeFractionalPercent(default_value=always),
        filter_enforced=base_pb2.RuntimeFractionalPercent(default_value=always),
        descriptors=[
            ratelimit_pb2.LocalRateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=DESCRIPTOR_KEY, value=tenant)],
                token_bucket=tenant_bucket(rate),
            )
            for tenant, rate in shares.items()
        ],
        rate_limits=[rc_pb2.RateLimit(actions=[_by_tenant(tenants)])],
        local_rate_limit_per_downstream_connection=False,
        always_consume_default_token_bucket=wrappers_pb2.BoolValue(value=False),
        rate_limited_as_resource_exhausted=False,
        enable_x_ratelimit_headers=ratelimit_pb2.DRAFT_VERSION_03,
    )
    virtual_host.typed_per_filter_config[LOCAL_RATE_LIMIT_FILTER].CopyFrom(_protos.pack(config))
    waits = virtual_host.metadata.filter_metadata[METADATA_NAMESPACE]
    for tenant, rate in shares.items():
        waits[tenant] = retry_after_s(rate)


def _by_tenant(tenants: TenantsConfig) -> _Any:
    """The rate limit action that makes a request's descriptor from its tenant."""
    action = rc_pb2.RateLimit.Action
    if tenants.header is not None:
        return action(
            request_headers=action.RequestHeaders(
                header_name=tenants.header, descriptor_key=DESCRIPTOR_KEY, skip_if_absent=True
            )
        )
    return action(
        metadata=action.MetaData(
            descriptor_key=DESCRIPTOR_KEY,
            metadata_key=metadata_key_pb2.MetadataKey(
                key=names.METADATA_NAMESPACE,
                path=[metadata_key_pb2.MetadataKey.PathSegment(key=TENANT_KEY)],
            ),
            source=action.MetaData.DYNAMIC,
            skip_if_absent=True,
        )
    )


def tenant_format(tenants: TenantsConfig) -> str | None:
    """The command operator printing a request's tenant (None: requests name none)."""
    if tenants.header is not None:
        return f"%REQ({tenants.header})%"
    if tenants.body_field is not None:
        return f"%DYNAMIC_METADATA({names.METADATA_NAMESPACE}:{TENANT_KEY})%"
    return None


def is_tenant(tenants: TenantsConfig, tenant: str) -> _Any:
    """An access log filter (as the local reply mappers use) for the requests of `tenant`."""
    exact = string_pb2.StringMatcher(exact=tenant)
    if tenants.header is not None:
        return accesslog_pb2.AccessLogFilter(
            header_filter=accesslog_pb2.HeaderFilter(
                header=rc_pb2.HeaderMatcher(name=tenants.header, string_match=exact)
            )
        )
    return accesslog_pb2.AccessLogFilter(
        metadata_filter=accesslog_pb2.MetadataFilter(
            matcher=metadata_pb2.MetadataMatcher(
                filter=names.METADATA_NAMESPACE,
                path=[metadata_pb2.MetadataMatcher.PathSegment(key=TENANT_KEY)],
                value=value_pb2.ValueMatcher(string_match=exact),
            ),
            match_if_key_not_found=wrappers_pb2.BoolValue(value=False),
        )
    )


def retry_after_format(tenant: str) -> str:
    """The command operator printing `tenant`'s Retry-After from the virtual host."""
    return f"%METADATA(VIRTUAL_HOST:{METADATA_NAMESPACE}:{tenant})%"
