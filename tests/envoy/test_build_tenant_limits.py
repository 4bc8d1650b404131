"""The tenants' rate limits as the builders describe them (_tenant_limits.py): the filter
in the listener, its configuration on the virtual host, the buckets and the 429 mappers."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from google.protobuf import json_format
from pydantic import ValidationError

from tests.envoy.static_bootstrap import hcm_of
from xds_server.config import Band, RoutingConfig, TenantsConfig, parse_config
from xds_server.envoy import _tenant_limits, build_listeners, build_routes, names
from xds_server.envoy.access_log import FIELDS, TENANT_FIELD
from xds_server.envoy.listeners import JSON_TO_METADATA_FILTER, ROUTER_FILTER
from xds_server.policy.admission import PoolAdmission
from xds_server.policy.decision import Decision
from xds_server.snapshot_builder import SnapshotBuilder, tenant_envoys
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

TENANTS_YAML = """
listener: {address: 127.0.0.1, port: 8080}
flow_control:
  tenants:
    header: x-tenant-id
    named:
      acme: {weight: 2, requests_per_s: 2.5}
      slow: {requests_per_s: 0.2}
      free: {weight: 3}
pools:
  - name: llm
    models: [base]
"""


UNLIMITED_YAML = TENANTS_YAML.replace("requests_per_s: 2.5", "weight: 1").replace(
    "{requests_per_s: 0.2}", "{weight: 1}"
)


def _config(yaml: str = TENANTS_YAML) -> RoutingConfig:
    return parse_config(yaml)


def _vhost_limit(config: RoutingConfig, envoys: int = 1) -> local_rate_limit_pb2.LocalRateLimit:
    (virtual_host,) = build_routes(config, envoys=envoys)[0].virtual_hosts
    packed = virtual_host.typed_per_filter_config[_tenant_limits.LOCAL_RATE_LIMIT_FILTER]
    limit = local_rate_limit_pb2.LocalRateLimit()
    assert packed.Unpack(limit)
    return limit


def _seconds(duration: Any) -> float:
    return float(duration.seconds + duration.nanos / 1e9)


def test_the_filter_comes_first_and_is_configured_by_the_virtual_host() -> None:
    hcm = hcm_of(build_listeners(_config())[0])
    filters = [f.name for f in hcm.http_filters]
    assert filters == [
        _tenant_limits.LOCAL_RATE_LIMIT_FILTER,
        JSON_TO_METADATA_FILTER,
        ROUTER_FILTER,
    ]
    own = local_rate_limit_pb2.LocalRateLimit()
    assert hcm.http_filters[0].typed_config.Unpack(own)
    # No bucket of its own: disabled where the routes do not configure it.
    assert not own.HasField("token_bucket")
    assert own.stat_prefix == _tenant_limits.STAT_PREFIX


def test_one_descriptor_per_limited_tenant_and_an_unlimited_default() -> None:
    limit = _vhost_limit(_config())
    entries = [[(e.key, e.value) for e in d.entries] for d in limit.descriptors]
    assert entries == [[("tenant", "acme")], [("tenant", "slow")]]  # `free` has no limit
    (rate_limit,) = limit.rate_limits
    (action,) = rate_limit.actions
    assert action.request_headers.header_name == "x-tenant-id"
    assert action.request_headers.descriptor_key == _tenant_limits.DESCRIPTOR_KEY
    assert action.request_headers.skip_if_absent
    assert limit.token_bucket.max_tokens == _tenant_limits.UNLIMITED
    assert not limit.always_consume_default_token_bucket.value
    assert limit.HasField("always_consume_default_token_bucket")
    assert not limit.local_rate_limit_per_downstream_connection
    assert not limit.rate_limited_as_resource_exhausted
    assert limit.enable_x_ratelimit_headers == ratelimit_pb2.DRAFT_VERSION_03
    assert limit.filter_enabled.default_value.numerator == 100
    assert limit.filter_enforced.default_value.numerator == 100


def test_each_envoy_gets_an_even_part_and_its_retry_after_rides_on_the_virtual_host() -> None:
    for envoys, acme_tokens, acme_fill_s, slow_wait in ((1, 2, 0.8, 5), (2, 1, 0.8, 10)):
        limit = _vhost_limit(_config(), envoys)
        acme, slow = (d.token_bucket for d in limit.descriptors)
        assert acme.tokens_per_fill.value == acme_tokens
        assert _seconds(acme.fill_interval) == pytest.approx(acme_fill_s)
        # Over the Envoys, the configured rate exactly.
        assert envoys * acme_tokens / _seconds(acme.fill_interval) == pytest.approx(2.5)
        assert envoys * slow.tokens_per_fill.value / _seconds(slow.fill_interval) == (
            pytest.approx(0.2)
        )
        (virtual_host,) = build_routes(_config(), envoys=envoys)[0].virtual_hosts
        waits = virtual_host.metadata.filter_metadata[_tenant_limits.METADATA_NAMESPACE]
        assert dict(waits) == {"acme": 1, "slow": slow_wait}


def _decision(*envoys: str) -> Decision:
    """A decision whose one pool's admission knows `envoys`."""
    bands: dict[Band, int] = {"critical": 1, "standard": 1, "sheddable": 1}
    admission = PoolAdmission(
        capacity=1,
        in_flight=bands,
        budget=bands,
        max_requests=bands,
        by_envoy=dict.fromkeys(envoys, bands),
        retry_after_s=bands,
    )
    return Decision(admissions={"llm": admission, "other": admission})


def test_the_fleet_is_every_envoy_the_admissions_know_when_a_tenant_is_limited() -> None:
    assert tenant_envoys(_config(), _decision("e1", "e2", "e3")) == 3
    assert tenant_envoys(_config(), Decision()) == 1
    assert tenant_envoys(_config(UNLIMITED_YAML), _decision("e1", "e2", "e3")) == 1


@pytest.mark.parametrize(
    ("rate", "tokens", "burst", "fill_s", "retry_after_s"),
    [
        (0.2, 1, 1, 5.0, 5),
        (1, 1, 1, 1.0, 1),
        (2.5, 2, 3, 0.8, 1),  # 2 tokens every 0.8 s: 2.5 per second
        (100, 100, 100, 1.0, 1),
        (1000, 1000, 1000, 1.0, 1),
    ],
)
def test_a_bucket_admits_the_rate_in_whole_tokens(
    rate: float, tokens: int, burst: int, fill_s: float, retry_after_s: int
) -> None:
    bucket = _tenant_limits.tenant_bucket(rate)
    assert bucket.tokens_per_fill.value == tokens
    assert bucket.max_tokens == burst
    assert _seconds(bucket.fill_interval) == pytest.approx(fill_s)
    assert _seconds(bucket.fill_interval) >= 0.05
    assert tokens / _seconds(bucket.fill_interval) == pytest.approx(rate, rel=1e-6)
    assert _tenant_limits.retry_after_s(rate) == retry_after_s


def test_the_429_of_each_limited_tenant_names_it_and_its_limit() -> None:
    hcm = hcm_of(build_listeners(_config())[0])
    mine = [
        m
        for m in hcm.local_reply_config.mappers
        if m.body_format_override.json_format.fields["error"]
        .struct_value.fields["code"]
        .string_value
        == "tenant_rate_limit_exceeded"
    ]
    assert len(mine) == 2
    acme, slow = mine
    for mapper, tenant, rate in ((acme, "acme", "2.5"), (slow, "slow", "0.2")):
        message = (
            f"{rate} requests per second; retry after"
            f" %METADATA(VIRTUAL_HOST:llm.tenant_retry_after:{tenant})% s."
        )
        status, header = mapper.filter.and_filter.filters
        assert status.status_code_filter.comparison.value.default_value == 429
        assert header.header_filter.header.name == "x-tenant-id"
        assert header.header_filter.header.string_match.exact == tenant
        error = mapper.body_format_override.json_format.fields["error"].struct_value.fields
        assert error["message"].string_value.startswith(f"Tenant {tenant} is over")
        assert error["message"].string_value.endswith(message)
        assert [(h.header.key, h.header.value) for h in mapper.headers_to_add] == [
            ("retry-after", f"%METADATA(VIRTUAL_HOST:llm.tenant_retry_after:{tenant})%")
        ]


def test_without_limited_tenants_nothing_is_added() -> None:
    config = _config(UNLIMITED_YAML)
    (virtual_host,) = build_routes(config)[0].virtual_hosts
    assert _tenant_limits.LOCAL_RATE_LIMIT_FILTER not in virtual_host.typed_per_filter_config
    plain = parse_config(
        "listener: {address: 127.0.0.1, port: 8080}\npools: [{name: llm, models: [base]}]"
    )
    hcm = hcm_of(build_listeners(plain)[0])
    assert _tenant_limits.LOCAL_RATE_LIMIT_FILTER not in [f.name for f in hcm.http_filters]


def test_named_tenants_need_the_header() -> None:
    with pytest.raises(ValidationError, match=r"needs flow_control\.tenants\.header"):
        TenantsConfig.model_validate({"named": {"acme": {"requests_per_s": 1}}})
    with pytest.raises(ValidationError):
        TenantsConfig.model_validate({"header": "x-t", "named": {"acme": {"requests_per_s": 0}}})


def test_the_request_log_names_the_tenant_when_a_header_does() -> None:
    def log_fields(config: RoutingConfig) -> dict[str, Any]:
        (log,) = hcm_of(build_listeners(config)[0]).access_log
        logger = file_pb2.FileAccessLog()
        assert log.typed_config.Unpack(logger)
        fields: dict[str, Any] = json_format.MessageToDict(logger.log_format.json_format)
        return fields

    assert log_fields(_config()) == {**FIELDS, TENANT_FIELD: "%REQ(x-tenant-id)%"}
    plain = parse_config(
        "listener: {address: 127.0.0.1, port: 8080}\npools: [{name: llm, models: [m]}]"
    )
    assert log_fields(plain) == FIELDS


BODY_YAML = TENANTS_YAML.replace("header: x-tenant-id", "body_field: user")


def test_a_body_field_names_the_tenant_after_json_to_metadata_reads_it() -> None:
    config = _config(BODY_YAML)
    hcm = hcm_of(build_listeners(config)[0])
    filters = [f.name for f in hcm.http_filters]
    assert filters == [
        JSON_TO_METADATA_FILTER,
        _tenant_limits.LOCAL_RATE_LIMIT_FILTER,
        ROUTER_FILTER,
    ]
    jtm = json_to_metadata_pb2.JsonToMetadata()
    assert hcm.http_filters[0].typed_config.Unpack(jtm)
    (rule,) = [r for r in jtm.request_rules.rules if r.selectors[0].key == "user"]
    assert (rule.on_present.metadata_namespace, rule.on_present.key) == ("llm", "tenant")
    assert rule.on_present.type == json_to_metadata_pb2.JsonToMetadata.STRING
    (action,) = _vhost_limit(config).rate_limits[0].actions
    assert action.metadata.descriptor_key == _tenant_limits.DESCRIPTOR_KEY
    assert action.metadata.metadata_key.key == "llm"
    assert [p.key for p in action.metadata.metadata_key.path] == ["tenant"]
    assert action.metadata.skip_if_absent
    (log,) = hcm.access_log
    assert "%DYNAMIC_METADATA(llm:tenant)%" in str(log.typed_config.value, "utf-8", "replace")
    acme = next(
        m
        for m in hcm.local_reply_config.mappers
        if m.HasField("filter")
        and m.filter.HasField("and_filter")
        and len(m.filter.and_filter.filters) == 2
        and m.filter.and_filter.filters[1].HasField("metadata_filter")
    )
    matcher = acme.filter.and_filter.filters[1].metadata_filter.matcher
    assert (matcher.filter, [p.key for p in matcher.path]) == ("llm", ["tenant"])
    assert matcher.value.string_match.exact == "acme"


def test_a_header_or_a_body_field_not_both() -> None:
    with pytest.raises(ValidationError, match="not both"):
        TenantsConfig.model_validate({"header": "x-t", "body_field": "user"})
    TenantsConfig.model_validate({"body_field": "safety_identifier", "named": {"a": {}}})


def test_the_builder_pushes_routes_when_the_fleet_grows_and_only_then() -> None:
    def acme_tokens(snapshot: Snapshot) -> int:
        routes = snapshot.resources[ResourceType.ROUTE][names.ROUTE_CONFIG_NAME].message
        limit = local_rate_limit_pb2.LocalRateLimit()
        packed = routes.virtual_hosts[0].typed_per_filter_config
        assert packed[_tenant_limits.LOCAL_RATE_LIMIT_FILTER].Unpack(limit)
        return int(limit.descriptors[0].token_bucket.tokens_per_fill.value)

    builder = SnapshotBuilder()
    one = builder.build(_config(), _decision("e1"))
    same = builder.build(_config(), _decision("e2"))
    two = builder.build(_config(), _decision("e1", "e2"))
    assert (acme_tokens(one), acme_tokens(two)) == (2, 1)
    assert same.versions[ResourceType.ROUTE] == one.versions[ResourceType.ROUTE]
    assert two.versions[ResourceType.ROUTE] != one.versions[ResourceType.ROUTE]
    assert two.versions[ResourceType.LISTENER] == one.versions[ResourceType.LISTENER]
    # Without a limited tenant the fleet's size pushes nothing.
    plain = SnapshotBuilder()
    before = plain.build(_config(UNLIMITED_YAML), _decision("e1"))
    after = plain.build(_config(UNLIMITED_YAML), _decision("e1", "e2"))
    assert after.versions[ResourceType.ROUTE] == before.versions[ResourceType.ROUTE]
