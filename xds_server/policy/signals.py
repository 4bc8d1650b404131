"""The policy's inputs from the pods: what each one's latest metrics say (metrics/ and
sources/ produce them), keyed by endpoint id."""

from __future__ import annotations

from dataclasses import dataclass

from xds_server.config import EndpointConfig

__all__ = ["PodSignals", "endpoint_id"]


def endpoint_id(endpoint: EndpointConfig) -> str:
    return f"{endpoint.address}:{endpoint.port}"


@dataclass(frozen=True, kw_only=True)
class PodSignals:
    """What the policy needs from one pod's latest metrics (metrics/ produces them).

    `silent_s`: how long the pod has failed to answer scrapes since its last good metrics
    (0 when the last scrape succeeded; it grows only while scrapes are tried, so a stall of
    this server does not age every pod at once). `down`: the last scrape could not connect
    at all (refused, reset): the pod is gone, whatever `all_stale` says. `scraped`: False
    for a pod with a verdict but no believed page yet (only failed scrapes): its other
    fields are then placeholders, and it is not in rotation. `probation_s`: the pod has
    given no believed page since it (re)started, its page is late and its health check
    answers: how long since its first answer (None otherwise; health.py's probation).
    """

    silent_s: float
    waiting: float
    running: float
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    # LoRA adapters of the pod's running and waiting requests; of those, the running ones
    # and the waiting ones (None: not told apart, all count as both); its adapter slots
    # (vLLM's max_lora; None: not reported yet, see _place_adapters).
    adapters: tuple[str, ...] = ()
    running_adapters: tuple[str, ...] | None = None
    waiting_adapters: tuple[str, ...] | None = None
    max_adapters: int | None = None
    # The adapters it ran most recently, newest first, up to its slots (vLLM's history of
    # `lora_requests_info`): where a restarted server's placement starts.
    recent_adapters: tuple[str, ...] = ()
    prefix_hit_rate: float | None = None
    # Prompt tokens its prefix cache saved per finished request, recently (None: unknown).
    cached_tokens_per_request: float | None = None
    down: bool = False
    scraped: bool = True
    # How long the engine has run requests without processing a token (its own counters).
    stalled_s: float = 0.0
    probation_s: float | None = None
