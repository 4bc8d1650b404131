"""The routing configuration: what operators write, validated before it is used.

The same document is read from a local file (the default) or from a Kubernetes
ConfigMap. Validation is strict (unknown keys are errors) because a typo that silently
falls back to a default is worse than a refused config: the server keeps the last good
config and says what was wrong.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent, Event
from yaml.nodes import Node
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from xds_server.apis import API_PATHS, DEFAULT_APIS, Api
from xds_server.errors import ConfigError
from xds_server.tuning import AdvancedOverrides, Tuning

__all__ = [
    "AccessLogConfig",
    "BANDS",
    "BalancingConfig",
    "Band",
    "ConfigError",
    "EndpointConfig",
    "Engine",
    "EngineMetricsConfig",
    "FailoverConfig",
    "FlowControlConfig",
    "Lane",
    "ListenerConfig",
    "MetricNamesConfig",
    "MetricSeries",
    "ModelBands",
    "ModelRewrite",
    "ParseLimits",
    "PodSelector",
    "PoolConfig",
    "RemoteConfig",
    "RemoteTlsConfig",
    "RewriteTarget",
    "RoutingConfig",
    "ScorerWeights",
    "TENANT_BANDS",
    "TenantConfig",
    "TenantsConfig",
    "UpdatesConfig",
    "UpstreamConfig",
    "VerdictsConfig",
    "load_config",
    "load_document",
    "load_yaml",
    "parse_config",
    "read_document",
]

Name = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")]
Port = Annotated[int, Field(ge=1, le=65535)]
ModelName = Annotated[str, Field(min_length=1, max_length=256)]
# Flow-control bands, most important first.
Band = Literal["critical", "standard", "sheddable"]
BANDS: tuple[Band, ...] = ("critical", "standard", "sheddable")
# The bands whose budget weighted tenants share (Critical is not limited).
TENANT_BANDS: tuple[Band, ...] = ("standard", "sheddable")
# The clusters of a pool, by the requests they carry: "pool" (the pool's own, weighted),
# "session" (session-keyed, consistent hashing: `session_affinity`) and "long" (long
# prompts, weighted, counted apart: `balancing.long_prompt_bytes`).
Lane = Literal["pool", "session", "long"]
# The model servers whose /metrics this server reads (`pools[].engine` in docs/configuration.md).
Engine = Literal["vllm", "sglang", "tgi", "triton", "trtllm"]
# Kubernetes label keys and values (the API server's own limits, simplified).
_LABEL_NAME = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
_LabelKey = Annotated[str, Field(pattern=rf"^([a-z0-9.-]{{1,253}}/)?{_LABEL_NAME}$")]
_LabelValue = Annotated[str, Field(pattern=rf"^({_LABEL_NAME})?$")]
_Namespace = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EndpointConfig(_Strict):
    """One model-server endpoint, as `address:port`, with its load-balancing weight."""

    address: str
    port: Port
    # What the session-affinity ring hashes to place keys (default: `address:port`); on
    # Kubernetes the pod's `namespace/name`, so where keys live depends on which pods
    # serve, not on their IPs (a StatefulSet pod back with a new IP gets its keys back).
    name: Annotated[
        str | None, Field(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,318}[A-Za-z0-9])?$")
    ] = None
    # The Kubernetes namespace of the pod behind the endpoint (discovery sets it, and `name`
    # to `namespace/name`): the `model_server_namespace` and `model_server_pod` labels of
    # the xds_pod_* metrics, which join them with the pod's own series.
    namespace: _Namespace | None = None
    # A static weight, used as is when the pool's metrics are not scraped (round robin, or
    # no metrics yet); GPU-aware balancing replaces it with a weight from live metrics.
    weight: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    # Hardware class (e.g. "h100"), looked up in `balancing.hardware_capacity`.
    hardware: str | None = None
    # The model server, when it differs from the pool's `engine`.
    engine: Engine | None = None
    # Takes no new requests and finishes the ones it has (Envoy's DRAINING); set for pods
    # being deleted, and usable by hand to take an endpoint out gracefully.
    draining: bool = False

    @property
    def ring_key(self) -> str:
        """What Envoy hashes for this endpoint on a session-affinity ring."""
        return self.name or f"{self.address}:{self.port}"

    @property
    def pod_name(self) -> str:
        """The pod's name in its namespace when known, else `name`, else `address:port`."""
        name = self.ring_key
        if self.namespace is not None and name.startswith(f"{self.namespace}/"):
            return name[len(self.namespace) + 1 :]
        return name

    @field_validator("address")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError as exc:
            raise ValueError(f"{value!r} is not an IP address") from exc
        return value


class PodSelector(_Strict):
    """Kubernetes pods that are a pool's endpoints: those with all of `match_labels`."""

    match_labels: Annotated[dict[_LabelKey, _LabelValue], Field(min_length=1)]
    # The port each pod serves the OpenAI API on (an InferencePool's `targetPorts`).
    target_port: Port
    # Where to look; empty means the namespaces the server watches (`--watch-namespace`).
    namespaces: tuple[_Namespace, ...] = ()

    @property
    def label_selector(self) -> str:
        """The selector as the Kubernetes API takes it: `a=b,c=d`, sorted."""
        return ",".join(f"{key}={value}" for key, value in sorted(self.match_labels.items()))


# A metric name as a page writes it (a counter's with its `_total`), and a label name.
_MetricName = Annotated[str, Field(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$", max_length=256)]
_PromLabel = Annotated[str, Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$", max_length=256)]


class MetricSeries(_Strict):
    """A metric name and the labels a series must carry to count (all of them, exactly):
    `{name: nv_trt_llm_request_metrics, labels: {request_type: waiting}}`."""

    name: _MetricName
    labels: dict[_PromLabel, Annotated[str, Field(max_length=256)]] = Field(default_factory=dict)


# One name, or candidates in order of preference (the first on the page wins); an empty
# list: the metric is not read.
MetricCandidates = _MetricName | MetricSeries | tuple[_MetricName | MetricSeries, ...]


class MetricNamesConfig(_Strict):
    """Where an engine's page says each thing the policy reads (metrics/engines.py's
    `LogicalMetric`); a field left out keeps the engine's own name."""

    waiting: MetricCandidates | None = None
    running: MetricCandidates | None = None
    kv_usage: MetricCandidates | None = None
    kv_capacity: MetricCandidates | None = None
    kv_tokens_per_block: MetricCandidates | None = None
    lora_info: MetricCandidates | None = None
    prefix_cache_hits: MetricCandidates | None = None
    prefix_cache_queries: MetricCandidates | None = None
    prompt_tokens: MetricCandidates | None = None
    generation_tokens: MetricCandidates | None = None
    requests_finished: MetricCandidates | None = None
    requests_prefilled: MetricCandidates | None = None

    @model_validator(mode="after")
    def _required_read(self) -> MetricNamesConfig:
        for name in ("waiting", "running"):
            if getattr(self, name) == ():
                raise ValueError(f"{name} is required and cannot be left unread")
        return self


class EngineMetricsConfig(_Strict):
    """How to read an engine's `/metrics` where it differs from the engine's defaults: a
    release that renames a metric, or a build that states its KV cache in other units.

    `capacity_unit` is what the `kv_capacity` series counts: tokens, or blocks (then
    multiplied by `tokens_per_block` if set, else by the `kv_tokens_per_block` series; with
    neither the capacity is unknown). Unset: the engine's own (blocks for Triton and
    trtllm-serve, tokens for the others).
    """

    names: MetricNamesConfig = MetricNamesConfig()
    capacity_unit: Literal["tokens", "blocks"] | None = None
    tokens_per_block: Annotated[int | None, Field(ge=1, le=1 << 20)] = None

    def over(self, base: EngineMetricsConfig) -> EngineMetricsConfig:
        """These settings over `base`'s: each name, unit or size set here wins."""
        names = {
            **base.names.model_dump(exclude_none=True),
            **self.names.model_dump(exclude_none=True),
        }
        return EngineMetricsConfig(
            names=MetricNamesConfig.model_validate(names),
            capacity_unit=self.capacity_unit or base.capacity_unit,
            tokens_per_block=self.tokens_per_block or base.tokens_per_block,
        )


_HostName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$|^[0-9a-fA-F:]+$",
    ),
]
_PeerAddress = Annotated[str, Field(pattern=r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")]


class RemoteTlsConfig(_Strict):
    """TLS from the Envoys to a remote gateway (an UpstreamTlsContext: docs/global.md)."""

    # The name the remote's certificate is for, sent as SNI and verified.
    sni: _HostName
    # The CA bundle (PEM) the remote's certificate must chain to, a path on the Envoys.
    ca_file: Annotated[str, Field(pattern=r"^/[^\x00]*$", max_length=4096)]
    # A client certificate and key (PEM paths on the Envoys) when the remote asks for one.
    cert_file: Annotated[str | None, Field(pattern=r"^/[^\x00]*$", max_length=4096)] = None
    key_file: Annotated[str | None, Field(pattern=r"^/[^\x00]*$", max_length=4096)] = None

    @model_validator(mode="after")
    def _cert_with_key(self) -> RemoteTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class RemoteConfig(_Strict):
    """Another cluster's gateway serving the same models: where a pool's traffic goes when
    its own pods cannot take it (EDS priority 1: docs/global.md)."""

    # Names the remote in metrics and logs (`remote` label).
    name: Name
    # An IP address, or a DNS name the server resolves (a Kubernetes Service, e.g.
    # `llm-gateway.llm.svc.clusterset.local`, or any host name): every address it has is
    # an endpoint.
    address: _HostName
    port: Port
    # The remote server's peering address ("host:port", its xDS port): its per-pool
    # summaries (health, saturation, capacity) steer the failover (docs/global.md). None:
    # the remote is used blind (Envoy's outlier detection alone judges it).
    peer: _PeerAddress | None = None
    # The pool's name in the remote cluster (None: the same name).
    pool: Name | None = None
    # TLS to the remote gateway; None: plaintext.
    tls: RemoteTlsConfig | None = None
    # Its share among the pool's usable remotes, before their summaries adjust it.
    weight: Annotated[int, Field(ge=1, le=1000)] = 100


class FailoverConfig(_Strict):
    """When a pool with `remotes` sends traffic to them, and how it takes it back
    (policy/failover.py, docs/global.md)."""

    # Saturation (requests running and waiting over the pods' batch limit) at which the
    # pool starts shedding to its remotes.
    saturation: Annotated[float, Field(gt=0, le=100)] = 1.5
    # While any traffic goes to remotes: at or above this, the local share steps down;
    # at or below `grow_below` (and no pod queueing) it steps up; between, it holds.
    back_off_at: Annotated[float, Field(gt=0, le=100)] = 1.0
    grow_below: Annotated[float, Field(gt=0, le=100)] = 0.8
    # Local pods healthy for this long before traffic returns to them.
    hold_s: Annotated[float, Field(ge=0, le=600)] = 2.0
    # From the first step back to all traffic local, at best (steps every `step_s`).
    ramp_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    step_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    # The least local share a saturated pool keeps (it still serves what it can).
    min_share: Annotated[float, Field(ge=0.01, le=1)] = 0.1
    # The least headroom (1 - saturation) a usable remote is weighed with: a full remote
    # still gets some of the traffic shed to remotes.
    min_headroom: Annotated[float, Field(gt=0, le=1)] = 0.05

    @model_validator(mode="after")
    def _ordered(self) -> FailoverConfig:
        if not self.grow_below < self.back_off_at <= self.saturation:
            raise ValueError("failover needs grow_below < back_off_at <= saturation")
        return self


class PoolConfig(_Strict):
    """A set of interchangeable model-server endpoints that serve the same models."""

    name: Name
    # How Envoy spreads a pool's requests over its endpoints: weighted least request (the
    # default: Envoy's own in-flight counting, per request) or round robin (what a
    # Kubernetes Service gives; the benchmark's baseline).
    balancing: Literal["least_request", "round_robin"] = "least_request"
    models: Annotated[tuple[ModelName, ...], Field(min_length=1)]
    # LoRA adapters the pool's pods can serve: a request whose `model` names one goes to a
    # pod that holds it (LoRA affinity), else to the pods with the most headroom.
    adapters: tuple[ModelName, ...] = ()
    # The OpenAI-style APIs the pool's servers answer (apis.py: each API's paths); a
    # request on a path of another API never reaches them (a JSON 404 from the gateway).
    api: Annotated[tuple[Api, ...], Field(min_length=1)] = DEFAULT_APIS
    # Consistent hashing with bounded load on the request's session key (`x-session-id`,
    # or the body's `prompt_cache_key` or `user`) so that a conversation, and the prompt
    # prefix it shares, meets the pod that has it cached. Requests without a key are
    # balanced by weighted least request as usual.
    session_affinity: bool = False
    # The most requests one of the pool's engines runs at once (vLLM's --max-num-seqs,
    # SGLang's --max-running-requests, TGI's --max-batch-size), which none of them exports.
    # With session_affinity, a pod whose batch nears it passes its keys on until it has
    # room (docs/routing.md); unset, only queues move keys.
    batch_limit: Annotated[int | None, Field(ge=1, le=1_000_000)] = None
    # The most adapters one of the pool's engines holds at once (vLLM's --max-loras,
    # SGLang's --max-loras-per-batch), which vLLM reports only once it has served a LoRA
    # request: known, the adapters are placed before the first one (docs/routing.md).
    adapter_slots: Annotated[int | None, Field(ge=1, le=10_000)] = None
    # Weights from live GPU metrics (least_request pools); False keeps the static weights
    # below, i.e. Envoy's least request on its own.
    gpu_aware: bool = True
    # The model server, for reading its /metrics (`pools[].engine` in docs/configuration.md).
    engine: Engine = "vllm"
    # Where each endpoint serves /metrics; by default its serving port, and its engine's
    # path (`/metrics`; trtllm-serve's Prometheus page is `/prometheus/metrics`, its
    # `/metrics` being JSON).
    metrics_port: Annotated[int | None, Field(ge=1, le=65535)] = None
    metrics_path: Annotated[str | None, Field(pattern=r"^/")] = None
    # How to read the metrics of the endpoints that run the pool's `engine`, over
    # `engine_metrics` (EngineMetricsConfig).
    metrics: EngineMetricsConfig | None = None
    endpoints: tuple[EndpointConfig, ...] = ()
    # On Kubernetes: the pods that are endpoints too (besides `endpoints`), found by label.
    selector: PodSelector | None = None
    # A change that takes away the last of the pool's `endpoints` is accepted: without it,
    # such a change is refused and the last good config stays (config_document.emptied_pools).
    allow_empty: bool = False
    # Bounds on a streamed request (`"stream": true`), per try, 0 for none. A pod sends a
    # stream's response headers at once (vLLM, SGLang), so `first_byte_s` bounds a pod
    # that does not answer at all (frozen, its server stuck): the request is tried again
    # on another pod. `stream_idle_s` bounds the silence before the first token (queueing
    # and prefill) and between chunks: a pod wedged mid-stream has it cut (the client sees
    # the stream end without `[DONE]`), one that never began has it tried elsewhere. A
    # request without `stream` sends nothing until it is done, so neither applies to it.
    first_byte_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    stream_idle_s: Annotated[float, Field(ge=0, le=3600)] = 60.0
    # The policy's numbers for this pool, over `balancing.advanced` (docs/tuning.md).
    advanced: AdvancedOverrides = Field(default_factory=dict)
    # Other clusters' gateways to fail over to (RemoteConfig), and when (FailoverConfig).
    remotes: tuple[RemoteConfig, ...] = ()
    failover: FailoverConfig = FailoverConfig()

    @property
    def weights_from_metrics(self) -> bool:
        """True when GPU-aware balancing sets the pool's weights (scraped least-request pools)."""
        return self.balancing == "least_request" and self.gpu_aware

    @field_validator("models", "adapters")
    @classmethod
    def _valid_models(cls, models: tuple[str, ...]) -> tuple[str, ...]:
        duplicates = sorted({m for m in models if models.count(m) > 1})
        if duplicates:
            raise ValueError(f"models listed twice: {', '.join(duplicates)}")
        for model in models:
            # Names in angle brackets are the gateway's own markers for "no model" and
            # "not JSON" (envoy/names.py); control characters cannot go into a header.
            if model.startswith("<") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in model):
                raise ValueError(f"model name {model!r} is reserved or has control characters")
        return models

    @field_validator("api")
    @classmethod
    def _api_once(cls, api: tuple[str, ...]) -> tuple[str, ...]:
        twice = sorted({a for a in api if api.count(a) > 1})
        if twice:
            raise ValueError(f"APIs listed twice: {', '.join(twice)}")
        return api

    @field_validator("advanced")
    @classmethod
    def _known_tuning(cls, advanced: dict[str, float]) -> dict[str, float]:
        Tuning.model_validate(advanced)
        return advanced

    @field_validator("remotes")
    @classmethod
    def _unique_remotes(cls, remotes: tuple[RemoteConfig, ...]) -> tuple[RemoteConfig, ...]:
        names = [r.name for r in remotes]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"remote names used twice: {', '.join(twice)}")
        return remotes

    @field_validator("endpoints")
    @classmethod
    def _unique_endpoints(cls, endpoints: tuple[EndpointConfig, ...]) -> tuple[EndpointConfig, ...]:
        seen: set[tuple[str, int]] = set()
        ring_keys: set[str] = set()
        for endpoint in endpoints:
            key = (endpoint.address, endpoint.port)
            if key in seen:
                raise ValueError(f"endpoint {endpoint.address}:{endpoint.port} listed twice")
            seen.add(key)
            if endpoint.ring_key in ring_keys:
                raise ValueError(f"endpoint name {endpoint.ring_key!r} used twice")
            ring_keys.add(endpoint.ring_key)
        return endpoints


class AccessLogConfig(_Strict):
    """Envoy's access log of the listener: one JSON line per request (envoy/access_log.py)."""

    enabled: bool = True
    # A file Envoy appends to; standard output by default, as a container's log wants.
    path: Annotated[str, Field(pattern=r"^/[^\x00]*$", max_length=4096)] = "/dev/stdout"
    # The share of successful requests logged; failed or refused ones are always logged.
    sample_percent: Annotated[float, Field(ge=0, le=100)] = 100.0


class ListenerConfig(_Strict):
    """Where Envoy accepts OpenAI-style traffic, and the limits of that traffic."""

    address: str = "0.0.0.0"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    # Header that names the model when the body does not (the body's `model` wins).
    model_header: Annotated[str, Field(pattern=r"^[a-z0-9-]+$")] = "x-gateway-model-name"
    # Largest request body Envoy buffers to read `model`; prompts can be many megabytes.
    max_request_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 32 * 1024 * 1024
    # Whole-request timeout; 0 disables it (long generations stream for minutes).
    request_timeout_s: Annotated[float, Field(ge=0)] = 0.0
    # Time a stream may go without any byte in either direction before Envoy resets it.
    stream_idle_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    connect_timeout_s: Annotated[float, Field(gt=0)] = 2.0
    # Bounds on clients (a slow or oversized client must not hold a connection): all of a
    # request's headers within this time (a slowloris is closed after it), headers of at
    # most this many KiB in all (more: a JSON 431; prompts travel in the body), and a
    # connection with no request in flight closed after this long.
    request_headers_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    max_request_headers_kb: Annotated[int, Field(ge=8, le=8192)] = 32
    idle_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 300.0
    access_log: AccessLogConfig = AccessLogConfig()

    @field_validator("address")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        return EndpointConfig._ip_address(value)


class UpstreamConfig(_Strict):
    """How Envoy treats a model server that fails: retries, ejection and hard limits.

    Retries: a request that never got response headers (connect failure, refused stream,
    reset before headers) is tried again on another pod, up to `retries` times; never
    after the first response byte. Retries in flight are at most `retry_budget_percent`
    of the requests in flight per cluster (at least `min_retry_concurrency`), so a failing
    fleet is not hit twice as hard. Sized so that one pod of two resetting all it gets
    (half the requests retried at once) stays within it, even in a burst of 32 (the
    docs/failures.md's clients): a refused retry is a 503 `retry_budget_exhausted`. Ejection
    (outlier detection): a pod with
    `eject_after_failures` connect failures, resets or timeouts in a row is out of that
    Envoy's rotation for `ejection_s` (longer each time it is ejected again, up to
    `max_ejection_s`), at most `max_ejection_percent` of a pool at once (Envoy always
    allows one). Circuit breaker of each pool cluster: `max_requests` in flight,
    `max_pending_requests` waiting for a connection, `max_connections` open.
    """

    retries: Annotated[int, Field(ge=0, le=10)] = 2
    retry_budget_percent: Annotated[float, Field(gt=0, le=100)] = 50.0
    min_retry_concurrency: Annotated[int, Field(ge=1, le=100_000)] = 16
    eject_after_failures: Annotated[int, Field(ge=1, le=1000)] = 3
    ejection_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    max_ejection_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    max_ejection_percent: Annotated[int, Field(ge=0, le=100)] = 50
    max_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 100_000
    max_pending_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 100_000
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = 100_000


class VerdictsConfig(_Strict):
    """Pods judged by what the Envoys see of them (LRS), not only by their metrics pages.

    A pod is suspected stalled when it owes `stall_after_owed` completions: its requests
    in flight, over time, divided by how long its pool's other pods take per request
    (Little's law on the same reports), with none finished since; the server then sends it
    a probe (a two-token streamed completion of its pool's first model), and one not
    served within `confirm_timeout_s` makes it `stalled`. It is `failing` when at least
    `min_failures` of its recent requests failed (resets, connect failures, 5xx) and those
    are `failure_ratio` of what it finished. Either takes it out of rotation (UNHEALTHY)
    at the next decision, until a probe is served within `probe_timeout_s`; probes start
    one second after the verdict and back off to `probe_max_interval_s`. GPU-aware pools
    only (the others have no decisions to change).
    """

    enabled: bool = True
    stall_after_owed: Annotated[float, Field(ge=1, le=1000)] = 3.0
    failure_ratio: Annotated[float, Field(gt=0, le=1)] = 0.5
    min_failures: Annotated[int, Field(ge=1, le=100_000)] = 5
    probe_timeout_s: Annotated[float, Field(gt=0, le=300)] = 5.0
    confirm_timeout_s: Annotated[float, Field(gt=0, le=300)] = 1.0
    probe_max_interval_s: Annotated[float, Field(ge=1, le=3600)] = 30.0


class ScorerWeights(_Strict):
    """Exponents of each scorer in the weight formula (0: off); see docs/routing.md."""

    capacity: Annotated[float, Field(ge=0, le=10)] = 4.0
    queue: Annotated[float, Field(ge=0, le=10)] = 2.0
    kv_cache: Annotated[float, Field(ge=0, le=10)] = 2.0
    running: Annotated[float, Field(ge=0, le=10)] = 0.0
    prefix_cache: Annotated[float, Field(ge=0, le=10)] = 0.0


class BalancingConfig(_Strict):
    """GPU-aware balancing: scraping each pod's metrics and turning them into EDS weights."""

    # How often every pod's /metrics is read, and how long one read may take.
    scrape_interval_s: Annotated[float, Field(ge=0.05, le=60)] = 0.25
    scrape_timeout_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    # A quiet pod (nothing waiting, a page that reads as the last one did) is scraped
    # this often instead (null: every scrape_interval_s); the first scrape that finds it
    # queueing or changed brings it back to scrape_interval_s.
    quiet_scrape_interval_s: Annotated[float, Field(ge=0.05, le=60)] | None = 0.5
    # Ask vLLM and SGLang (prometheus-client's exposition) for only the series read
    # (`/metrics?name[]=...`): a tenth of the bytes and a fraction of the CPU per scrape.
    scrape_by_name: bool = True
    # The most bytes of one pod's metrics page read (a vLLM page is ~60 KB); a longer page
    # is cut there and counts as a failed scrape (kind too_large).
    max_metrics_page_bytes: Annotated[int, Field(ge=65_536, le=64 << 20)] = 1 << 20
    # A pod whose KV-cache capacity is over this many times the median of the pool's other
    # pods of its hardware class (two or more of them) is not believed (kind implausible).
    max_capacity_ratio: Annotated[float, Field(ge=2, le=1e6)] = 16.0
    # A pod whose last good metrics are older than this leaves rotation until they resume.
    stale_after_s: Annotated[float, Field(gt=0, le=600)] = 2.0
    # A pod whose engine runs requests and has processed no token (prefill or generation,
    # by its own counters: vLLM, SGLang) for this long leaves rotation until they move.
    stall_after_s: Annotated[float, Field(gt=0, le=600)] = 1.0
    # When every pod of a pool is stale: keep routing on the last weights ("fail_open") or
    # answer 503 ("fail_closed").
    all_stale: Literal["fail_open", "fail_closed"] = "fail_open"
    scorers: ScorerWeights = ScorerWeights()
    # Relative serving capacity per hardware class (an endpoint's `hardware`); endpoints
    # without one are sized from their KV-cache capacity (`cache_config_info`).
    hardware_capacity: dict[Annotated[str, Field(min_length=1)], Annotated[float, Field(gt=0)]] = {}
    # Smoothing of scores between scrapes (1 = no smoothing).
    smoothing: Annotated[float, Field(gt=0, le=1)] = 0.5
    # Envoy's bounded load for session affinity, in percent (null: off): a pod over this
    # multiple of the mean of the session cluster's requests in flight at one Envoy passes
    # a key on to the next pod of its permutation. Off by default: it reads a pod against
    # the others, not against its own room, so it moves keys (each a whole prefill) from a
    # pod that has room while the pool is quiet; the spill rules read each pod's own queue
    # and batch (docs/configuration.md).
    hash_balance_factor: Annotated[int, Field(ge=100, le=1000)] | None = None
    # Where the keys of a pod that spills go (docs/routing.md, Where a keyed and an unkeyed request
    # go): "pool" balances their requests by the pool's load-following weights, through an
    # internal listener that the pod's entry in the session table points at while it
    # spills (the Envoy bootstrap must enable `envoy.bootstrap.internal_listener`, as
    # `xds-server bootstrap` does); "ring" hands each key to the next pod of its Maglev
    # permutation, which may be another loaded pod, while an idle one waits.
    spill_to: Literal["pool", "ring"] = "pool"
    # Where a session key lives: "buckets" keeps a table of key buckets that Envoy reads
    # (`xxHash64(key) % key_buckets`, each pinned to the pod that took its first key; the
    # others offered to the pods under their share: policy/buckets.py), so that a key is
    # homed at first sight and never moved by another key's placement; "hash" places keys
    # by the session cluster's Maglev ring weights (policy/homes.py). Buckets only in
    # GPU-aware pools with session affinity, `spill_to: pool`, no LoRA adapters and no
    # remotes; others keep "hash" (docs/routing.md).
    key_homes: Literal["hash", "buckets"] = "buckets"
    key_buckets: Annotated[int, Field(ge=2, le=1024)] = 256
    # How often each Envoy sends the server its keyed requests (the session-key log, in
    # batches; sooner at 64 KiB). A new key's bucket is pinned at the first decision after
    # its first request is logged; until then its requests go to the pod with the fewest in
    # flight. Each batch is one gRPC message, 30-50 us of the server's CPU beyond its entries:
    # at 0.1 s, 500 busy Envoys cost 15-25% of a core more than at 0.5 s (docs/operations.md).
    key_log_flush_s: Annotated[float, Field(ge=0.05, le=5)] = 0.1
    # With key buckets, how long a pod that took a key's first request (a prefill of the
    # whole prompt: nothing of that key is cached there) is passed over by new keys while
    # another pod took fewer such requests: about one prefill of the pool's shared prefixes.
    # Two new keys on one pod queue one whole prefill behind the other (0: off).
    new_key_prefill_s: Annotated[float, Field(ge=0, le=5)] = 0.5
    # How much Envoy's own in-flight count corrects the weights in GPU-aware pools: above 0,
    # Envoy's least request picks by weight / (active + 1)^bias when weights differ
    # (least_request_lb_config active_request_bias) and by power of two choices on active
    # requests when they are equal. 0 (default): the weights alone, as Envoy's weighted
    # round robin, which on equal weights is plain round robin: spacing new requests evenly
    # beats least request there (a new request's prefill, not the decodes in flight, is
    # what its first token waits for).
    active_request_bias: Annotated[float, Field(ge=0, le=10)] = 0.0
    # Waiting requests the queue scorer ignores: a request that arrived during an engine
    # step waits for the next one even on an idle pod, so a single waiting request at
    # scrape time is noise on a pod with room, not a queue.
    queue_slack: Annotated[int, Field(ge=0, le=1000)] = 1
    # Requests whose content-length is at least this many bytes carry a long prompt (0: no
    # long-prompt lane). In a GPU-aware pool they go to the pool's `<pool>/long` cluster,
    # whose upstream streams Envoy logs to this server, and while one prefills on a pod
    # that pod's weight is multiplied by `long_prompt_weight_factor` (once per long
    # prompt): a long prefill holds the pod's token budget for seconds, and a short
    # request sent there waits behind it. 32 KiB is about 8k tokens of English in JSON.
    long_prompt_bytes: Annotated[int, Field(ge=0)] = 32_768
    long_prompt_weight_factor: Annotated[float, Field(gt=0, le=1)] = 0.01
    # Every pool's policy numbers (docs/tuning.md); a pool's `advanced` overrides them.
    advanced: Tuning = Tuning()
    # In a pool with session affinity, a request without a session key is keyed by the
    # first this many bytes of its body's `prompt` as JSON text (0: off), and sticks to a
    # pod like a keyed one. Envoy reaches only a completions `prompt` string of at most
    # 8 KiB: not a chat's messages, nor a longer prompt (docs/routing.md). Off by default: it moves
    # every keyless completion of such a pool onto the consistent-hash ring, and too few
    # bytes pile prompts that share only a template's opening onto one pod; set it to the
    # length of the prefixes the clients share (512 bytes is about 128 tokens of English).
    prefix_key_bytes: Annotated[int, Field(ge=0, le=8192)] = 0

    def keeps_buckets(self, pool: PoolConfig) -> bool:
        """Whether `pool`'s session keys live in a table of key buckets (`key_homes`
        "buckets"): a GPU-aware pool (the policy keeps the table) with session affinity,
        `spill_to: pool`, no LoRA adapters and no remotes."""
        return (
            pool.session_affinity
            and pool.weights_from_metrics
            and self.spill_to == "pool"
            and self.key_homes == "buckets"
            and not pool.adapters
            and not pool.remotes
        )


class ModelBands(_Strict):
    """The band a model's requests get when they name none, and the highest they may ask for."""

    default_band: Band = "standard"
    max_band: Band = "critical"


class TenantConfig(_Strict):
    """One named tenant: its weight, for its fair share of each band's budget (with flow
    control: a lane of its own per pool and band, docs/flow-control.md "Tenants"), and its
    request rate limit, enforced by Envoy's local rate limit filter."""

    # None: no lane of its own (its requests share the band's lane with everyone else's).
    weight: Annotated[float, Field(gt=0, le=1000)] | None = None
    # Requests per second this tenant may send over the fleet's Envoys, each holding an even
    # part (with flow control; without, through each Envoy). None: no limit.
    requests_per_s: Annotated[float, Field(gt=0, le=1_000_000)] | None = None


class TenantsConfig(_Strict):
    """Who sent a request (the `header`, set by the auth layer, or else a `body_field` of
    the JSON body) and each named tenant's limits. A request that names no tenant, or one
    not listed, is not limited."""

    header: Annotated[str, Field(pattern=r"^[a-z0-9-]+$")] | None = None
    # OpenAI's `user` or `safety_identifier`, read by json_to_metadata (a string).
    body_field: Literal["user", "safety_identifier"] | None = None
    # Names are printed into Envoy's command operators: no `:` nor `%`.
    named: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9._@+/=-]{1,256}$")], TenantConfig] = {}

    @model_validator(mode="after")
    def _one_source(self) -> TenantsConfig:
        if self.header is not None and self.body_field is not None:
            raise ValueError("flow_control.tenants: set header or body_field, not both")
        if self.named and not self.named_by():
            raise ValueError(
                "flow_control.tenants.named needs flow_control.tenants.header or body_field"
            )
        return self

    def named_by(self) -> bool:
        """Whether requests name their tenant (a header or a body field)."""
        return self.header is not None or self.body_field is not None

    def weighted(self) -> dict[str, float]:
        """The weight of each tenant that has one, by name (sorted): the tenants with lanes
        of their own."""
        return {
            name: tenant.weight
            for name, tenant in sorted(self.named.items())
            if tenant.weight is not None
        }

    def rate_limited(self) -> dict[str, float]:
        """The request rate of each tenant that has one, by name (sorted)."""
        return {
            name: tenant.requests_per_s
            for name, tenant in sorted(self.named.items())
            if tenant.requests_per_s is not None
        }


class FlowControlConfig(_Strict):
    """Admission per band (Critical, Standard, Sheddable) when demand exceeds the GPUs.

    A request's band comes from, in order: the `x-gateway-inference-objective` header
    naming an objective (priority < 0 Sheddable, 0 Standard, > 0 Critical), the
    `band_header`, the model's `default_band`, else Standard; never above its `max_band`.
    """

    enabled: bool = False
    # The header a client names its band in: critical, standard or sheddable.
    band_header: Annotated[str, Field(pattern=r"^[a-z0-9-]+$")] = "x-gateway-inference-band"
    # Objectives by name and integer priority (InferenceObjectives add to these).
    objectives: dict[Annotated[str, Field(min_length=1, max_length=253)], int] = {}
    models: dict[ModelName, ModelBands] = {}
    # Requests one pod serves at once without queueing, per hardware class (an endpoint's
    # `hardware`), and for pods without one.
    pod_concurrency: dict[Annotated[str, Field(min_length=1)], Annotated[int, Field(ge=1)]] = {}
    default_pod_concurrency: Annotated[int, Field(ge=1, le=100_000)] = 32
    # The share of capacity Standard and Sheddable may not take: free places for Critical
    # requests to start at once, between two limit updates, instead of queueing in a pod.
    critical_headroom: Annotated[float, Field(ge=0, le=0.9)] = 0.1
    # Sheddable requests are admitted only while the pool runs below this share of the
    # places Standard may fill: Sheddable is refused first, and leaves Standard room to grow.
    sheddable_utilization: Annotated[float, Field(ge=0, le=1)] = 0.8
    # Places of each band's budget every Envoy keeps whatever its demand, so that an Envoy
    # whose traffic starts can admit at once (the rest follows each Envoy's demand).
    envoy_floor: Annotated[int, Field(ge=0, le=10_000)] = 1
    # Bounds of the Retry-After a refused request gets (the value is the expected drain time).
    retry_after_min_s: Annotated[int, Field(ge=1, le=3600)] = 1
    retry_after_max_s: Annotated[int, Field(ge=1, le=3600)] = 60
    # Tenants and their request rate limits (TenantsConfig).
    tenants: TenantsConfig = TenantsConfig()

    def band_of_priority(self, priority: int) -> Band:
        return "sheddable" if priority < 0 else "critical" if priority > 0 else "standard"


class UpdatesConfig(_Strict):
    """How bursts of input changes are folded into one push (Istio uses 100 ms / 10 s)."""

    debounce_s: Annotated[float, Field(ge=0, le=10)] = 0.1
    max_delay_s: Annotated[float, Field(ge=0, le=60)] = 1.0


class RewriteTarget(_Strict):
    """One share of a rewritten model's traffic: the model it goes to, and its weight."""

    model: ModelName
    weight: Annotated[int, Field(ge=0, le=1_000_000)]


class ModelRewrite(_Strict):
    """A weighted split (canary) of the requests for `model` over other models' pools.

    Envoy picks a target per request by weight and routes to the pool serving it, with
    `x-gateway-model-name` set to the target. The body's `model` is not rewritten (stock
    Envoy cannot edit a JSON body without a callout), so each target's servers must accept
    the requested name too (vLLM: `--served-model-name` with both names).
    """

    model: ModelName
    targets: Annotated[tuple[RewriteTarget, ...], Field(min_length=1)]

    @model_validator(mode="after")
    def _sensible_targets(self) -> ModelRewrite:
        names = [t.model for t in self.targets]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"targets listed twice for {self.model!r}: {', '.join(twice)}")
        if not any(t.weight for t in self.targets):
            raise ValueError(f"every target of {self.model!r} has weight 0")
        return self


class RoutingConfig(_Strict):
    """The whole routing document."""

    listener: ListenerConfig = ListenerConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    pools: Annotated[tuple[PoolConfig, ...], Field(min_length=1)]
    # Weighted splits between model names (canary); see ModelRewrite.
    model_rewrites: tuple[ModelRewrite, ...] = ()
    balancing: BalancingConfig = BalancingConfig()
    updates: UpdatesConfig = UpdatesConfig()
    flow_control: FlowControlConfig = FlowControlConfig()
    verdicts: VerdictsConfig = VerdictsConfig()
    # How to read each engine's metrics, for every endpoint that runs it (EngineMetricsConfig;
    # a pool's `metrics` win for its own engine's endpoints).
    engine_metrics: dict[Engine, EngineMetricsConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique_names(self) -> RoutingConfig:
        pool_names = [p.name for p in self.pools]
        twice = sorted({n for n in pool_names if pool_names.count(n) > 1})
        if twice:
            raise ValueError(f"pool names used twice: {', '.join(twice)}")
        owner: dict[str, str] = {}
        for pool in self.pools:
            for model in (*pool.models, *pool.adapters):
                if model in owner:
                    raise ValueError(
                        f"model {model!r} is served by both pool {owner[model]!r} and {pool.name!r}"
                    )
                owner[model] = pool.name
        rewritten = [r.model for r in self.model_rewrites]
        twice = sorted({m for m in rewritten if rewritten.count(m) > 1})
        if twice:
            raise ValueError(f"models rewritten twice: {', '.join(twice)}")
        known = {*owner, *rewritten}
        unknown = sorted(m for m in self.flow_control.models if m not in known)
        if unknown:
            raise ValueError(
                f"flow_control.models names models no pool serves: {', '.join(unknown)}"
            )
        if self.flow_control.retry_after_min_s > self.flow_control.retry_after_max_s:
            raise ValueError("flow_control.retry_after_min_s is above retry_after_max_s")
        for rewrite in self.model_rewrites:
            unserved = sorted(t.model for t in rewrite.targets if t.model not in owner)
            if unserved:
                raise ValueError(
                    f"rewrite of {rewrite.model!r} targets models no pool serves: "
                    f"{', '.join(unserved)}"
                )
        return self

    @model_validator(mode="after")
    def _pool_tuning_valid(self) -> RoutingConfig:
        for pool in self.pools:
            try:
                self.tuning(pool)
            except ValidationError as error:
                raise ValueError(f"pool {pool.name!r}: advanced: {error}") from None
        return self

    @model_validator(mode="after")
    def _splits_share_an_api(self) -> RoutingConfig:
        for rewrite in self.model_rewrites:
            if not self.rewrite_api(rewrite):
                raise ValueError(
                    f"rewrite of {rewrite.model!r} splits over pools that serve no API in "
                    "common (pools[].api)"
                )
        return self

    def metrics_of(self, pool: PoolConfig, engine: Engine) -> EngineMetricsConfig:
        """How to read the metrics of `pool`'s endpoints that run `engine`: the pool's
        `metrics` (when `engine` is the pool's) over `engine_metrics`."""
        base = self.engine_metrics.get(engine, EngineMetricsConfig())
        if pool.metrics is not None and engine == pool.engine:
            return pool.metrics.over(base)
        return base

    def tuning(self, pool: PoolConfig) -> Tuning:
        """The policy's numbers for `pool`: `balancing.advanced` with its `advanced`."""
        return self.balancing.advanced.with_overrides(pool.advanced)

    def lanes(self, pool: PoolConfig) -> tuple[Lane, ...]:
        """The lanes (clusters) of `pool`: its own, then "session" with session affinity, then
        "long" when GPU-aware balancing is on and long prompts have a lane."""
        lanes: list[Lane] = ["pool"]
        if pool.session_affinity:
            lanes.append("session")
        if pool.weights_from_metrics and self.balancing.long_prompt_bytes > 0:
            lanes.append("long")
        return tuple(lanes)

    def spills(self, pool: PoolConfig) -> bool:
        """Whether `pool`'s spilling pods send their keys' requests to its spill listener
        (session affinity with `balancing.spill_to` "pool")."""
        return pool.session_affinity and self.balancing.spill_to == "pool"

    def bucket_homes(self, pool: PoolConfig) -> bool:
        """Whether `pool`'s session keys live in a table of key buckets
        (BalancingConfig.keeps_buckets)."""
        return self.balancing.keeps_buckets(pool)

    def pool_of(self, model: str) -> PoolConfig | None:
        """The pool serving `model` (a model or a LoRA adapter), or None when no pool does."""
        return next((p for p in self.pools if model in p.models or model in p.adapters), None)

    def rewrite_api(self, rewrite: ModelRewrite) -> tuple[Api, ...]:
        """The APIs of `rewrite`'s split: those every pool it can send to (a target with
        weight) serves, in apis.API_PATHS's order. Envoy picks the target by weight alone, so
        a request on any other API could land on a pool that does not serve it."""
        pools = [self.pool_of(t.model) for t in rewrite.targets if t.weight]
        return tuple(a for a in API_PATHS if all(a in p.api for p in pools if p is not None))


@dataclass(frozen=True, kw_only=True)
class ParseLimits:
    """How much work a routing document may cost before it is refused unparsed.

    PyYAML's safe loader bounds none of it. An alias shares its anchor's node, so loading
    is cheap, but whatever reads the result (validation, a merge key `<<`) walks the anchor
    at every use: a few kilobytes of aliases of aliases ("billion laughs") cost minutes.
    The composer counts every node an alias stands for, at every use, and stops at the
    first one over `max_alias_nodes`; a document without aliases is bounded by its size.
    """

    # Bytes of the document (a ConfigMap holds at most 1 MiB anyway).
    max_bytes: int = 1 << 20
    # Aliases (`*name`) in the document, and the nodes they add once expanded.
    max_aliases: int = 256
    max_alias_nodes: int = 100_000
    # Nesting of mappings and sequences (a routing config needs 6).
    max_depth: int = 64

    def check_size(self, size: int, *, source: str) -> None:
        """Raise ConfigError when a document of `size` bytes is over `max_bytes`."""
        if size > self.max_bytes:
            raise ConfigError(
                f"{source}: refused: {size} bytes, over the limit of {self.max_bytes} bytes"
            )


class _TooComplex(Exception):
    """A document over one of its ParseLimits; the message says which."""


class _BoundedComposer(Composer):
    """PyYAML's composer, counting aliases, the nodes they stand for, and the depth."""

    def __init__(self, limits: ParseLimits) -> None:
        super().__init__()
        self._limits = limits
        self._aliases = 0
        # Nodes composed so far, an alias counting as every node under its anchor.
        self._nodes = 0
        self._alias_nodes = 0
        self._depth = 0
        # Anchor -> the nodes under it (itself included), once it is composed.
        self._sizes: dict[str, int] = {}

    if TYPE_CHECKING:  # the parser's, the other base of every loader

        def peek_event(self) -> Event | None: ...

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            self._alias(str(event.anchor))
            return super().compose_node(parent, index)
        limits = self._limits
        if self._depth >= limits.max_depth:
            raise _TooComplex(f"nested deeper than {limits.max_depth} levels")
        start = self._nodes
        self._nodes += 1
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._sizes[anchor] = self._nodes - start
        return node

    def _alias(self, anchor: str) -> None:
        limits = self._limits
        self._aliases += 1
        if self._aliases > limits.max_aliases:
            raise _TooComplex(f"more than {limits.max_aliases} YAML aliases")
        if anchor in self.anchors and anchor not in self._sizes:
            raise _TooComplex(f"the alias *{anchor} is inside its own anchor (a cycle)")
        # An undefined anchor counts 0 here; the composer refuses it next.
        size = self._sizes.get(anchor, 0)
        self._nodes += size
        self._alias_nodes += size
        if self._alias_nodes > limits.max_alias_nodes:
            raise _TooComplex(
                f"YAML aliases expand to more than {limits.max_alias_nodes} nodes "
                f"(after {self._aliases} aliases)"
            )


class _Loader(Reader, Scanner, Parser, _BoundedComposer, SafeConstructor, Resolver):
    """yaml.SafeLoader with a bounded composer (all in Python)."""

    def __init__(self, document: str | bytes, limits: ParseLimits) -> None:
        Reader.__init__(self, document)
        Scanner.__init__(self)
        Parser.__init__(self)
        _BoundedComposer.__init__(self, limits)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)


if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _CLoader(_BoundedComposer, CParser, SafeConstructor, Resolver):
        """libyaml's scanner and parser (C) under the bounded composer: about 5 times
        faster than `_Loader` (1 MiB composed in 0.4 s instead of 2.5 s)."""

        def __init__(self, document: str | bytes, limits: ParseLimits) -> None:
            CParser.__init__(self, document)
            _BoundedComposer.__init__(self, limits)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)


def load_yaml(document: str | bytes, *, source: str, limits: ParseLimits) -> Any:
    """The document as yaml.safe_load reads it, but refused (ConfigError, naming the limit)
    as soon as it is over `limits` in aliases, what they expand to, or depth."""
    loader = _CLoader(document, limits) if yaml.__with_libyaml__ else _Loader(document, limits)
    try:
        node = loader.get_single_node()
        return None if node is None else loader.construct_document(node)
    except _TooComplex as exc:
        raise ConfigError(f"{source}: refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    except (ValueError, OverflowError) as exc:
        # A value the safe constructor cannot build (an int of more than 4,300 digits).
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    finally:
        loader.dispose()


def load_document(document: str | bytes, *, source: str, limits: ParseLimits) -> Any:
    """The document read as JSON when it is JSON (what tools generate; 50 times faster than
    the YAML loader on a fleet's 10,000 endpoints), else as YAML (`load_yaml`). JSON is
    YAML, so both readings agree; JSON's non-standard NaN and Infinity are not taken (the
    YAML loader reads what it reads of them), and its nesting is held to `max_depth`."""
    head = document.lstrip()[:1]
    if head in ("{", b"{"):
        try:
            value = json.loads(document, parse_constant=_not_json)
        except (ValueError, RecursionError):
            pass  # YAML's flow style, or not valid at all: the YAML loader says which
        else:
            if _depth_over(value, limits.max_depth):
                raise ConfigError(
                    f"{source}: refused: nested deeper than {limits.max_depth} levels"
                )
            return value
    return load_yaml(document, source=source, limits=limits)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _depth_over(value: Any, max_depth: int) -> bool:
    """Whether `value` (parsed JSON) nests mappings and lists deeper than `max_depth`."""
    level = [value]
    for _ in range(max_depth):
        level = [
            child
            for node in level
            if isinstance(node, dict | list)
            for child in (node.values() if isinstance(node, dict) else node)
        ]
    return any(isinstance(node, dict | list) for node in level)


# Problems listed in a ConfigError; the rest are counted.
_MAX_PROBLEMS = 20


def parse_config(
    document: str | bytes, *, source: str = "config", limits: ParseLimits = ParseLimits()
) -> RoutingConfig:
    """Parse and validate a YAML (or JSON) routing document.

    Raises ConfigError with the problems found (the first 20, and how many more; all of
    them in its `problems`), each naming its field path. A document over `limits` is
    refused first, with the limit it broke; the work done is bounded by them.
    """
    data = document.encode(errors="surrogatepass") if isinstance(document, str) else document
    limits.check_size(len(data), source=source)
    raw = load_document(document, source=source, limits=limits)
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {type(raw).__name__}"
        )
    try:
        return RoutingConfig.model_validate(raw)
    except ValidationError as exc:
        problems = _problems(exc)
        listed = list(problems[:_MAX_PROBLEMS])
        if len(problems) > _MAX_PROBLEMS:
            listed.append(f"and {len(problems) - _MAX_PROBLEMS} more problems")
        raise ConfigError(f"{source}: {'; '.join(listed)}", problems=problems) from exc


def _problems(error: ValidationError) -> tuple[str, ...]:
    """Each of `error`'s problems as `path.to.field: message`. A list shorter than its
    minimum only because its items failed is not one more problem: pydantic counts the
    items that passed, and "pools: at least 1 item" beside a bad pool would mislead."""
    errors = error.errors()
    inside = {err["loc"][:n] for err in errors for n in range(len(err["loc"]))}
    return tuple(
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
        for err in errors
        if not (err["type"] == "too_short" and err["loc"] in inside)
    )


def read_document(path: Path, *, limits: ParseLimits = ParseLimits()) -> bytes:
    """The bytes of the file at `path`. Raises ConfigError when it cannot be read or is over
    `limits.max_bytes`, checked before reading (and while reading: the file may grow)."""
    try:
        with path.open("rb") as file:
            limits.check_size(os.fstat(file.fileno()).st_size, source=str(path))
            document = file.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    if len(document) > limits.max_bytes:
        raise ConfigError(
            f"{path}: refused: over the limit of {limits.max_bytes} bytes (it grew while read)"
        )
    return document


def load_config(path: Path, *, limits: ParseLimits = ParseLimits()) -> RoutingConfig:
    """Read and validate the routing document at `path` (see `read_document`)."""
    return parse_config(read_document(path, limits=limits), source=str(path), limits=limits)
