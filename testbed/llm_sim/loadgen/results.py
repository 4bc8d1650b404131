"""What a replay measured, per request and for the generator itself, and its JSON form.

Kept apart from `replay.py` (which does the I/O) so that `stats.py` and the benchmark
reports can read results without importing aiohttp, and so that a replay run in a
subprocess hands its results back as a file that round-trips exactly.

All times are seconds on the replaying process's monotonic clock, relative to the start
of the replay (the instant the trace's offset 0 maps to).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_sim.loadgen.errors import TraceFormatError

__all__ = ["ErrorKind", "OK_STATUS", "ReplayResult", "RequestResult"]

_FORMAT = "xds-server-replay"
_VERSION = 1

OK_STATUS = 200


class ErrorKind(enum.StrEnum):
    """Why a request got no complete HTTP response.

    CONNECT: the TCP connection could not be made. TIMEOUT: `timeout_s` passed first.
    RESET: the connection closed or the body was cut off mid-response. INCOMPLETE: the
    stream ended cleanly but without `data: [DONE]`. PROTOCOL: a response that is not
    HTTP, or a body that is not the JSON (or UTF-8) it should be. DROPPED_BY_CLIENT: never
    sent, because `max_in_flight` requests were already open (the open-loop schedule is
    never delayed).
    """

    CONNECT = "connect"
    DROPPED_BY_CLIENT = "dropped_by_client"
    INCOMPLETE = "incomplete"
    PROTOCOL = "protocol"
    RESET = "reset"
    TIMEOUT = "timeout"


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestResult:
    """One request's outcome.

    `status` is the HTTP status, or None when no response arrived (`error` says why).
    A 200 whose stream broke has both a status and an `error`. `ttft_s` is the time from
    sending to the first SSE chunk carrying content (None for non-streamed requests and
    when no content came); `tpot_s` is (e2e - ttft) / (output_tokens - 1), None below two
    tokens. `output_tokens` comes from the final usage chunk, else from counting the
    streamed words. `retry_after` and `error_code` (the OpenAI-style body's `error.code`)
    are filled for refusals (status other than 200). `error_json` says whether such a
    response's body was JSON (content-type application/json, and it parses): None for a
    200 and for no response. `lateness_s` is how long after its scheduled time the request
    was actually sent.
    """

    index: int
    band: str
    model: str
    scheduled_at_s: float
    lateness_s: float
    status: int | None
    error: ErrorKind | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    backend_id: str | None = None
    retry_after: str | None = None
    error_code: str | None = None
    error_json: bool | None = None

    @property
    def ok(self) -> bool:
        """A complete 200 response."""
        return self.status == OK_STATUS and self.error is None

    @property
    def outcome(self) -> str:
        """The status as counted in reports: "200", "429", ..., or "error:<kind>"."""
        if self.error is not None and (self.status is None or self.status == OK_STATUS):
            return f"error:{self.error.value}"
        return str(self.status)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "band": self.band,
            "model": self.model,
            "scheduled_at_s": self.scheduled_at_s,
            "lateness_s": self.lateness_s,
            "status": self.status,
            "error": None if self.error is None else self.error.value,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "output_tokens": self.output_tokens,
            "backend_id": self.backend_id,
            "retry_after": self.retry_after,
            "error_code": self.error_code,
            "error_json": self.error_json,
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> RequestResult:
        """Raises KeyError, TypeError or ValueError on a malformed document."""
        error = document["error"]
        return cls(
            index=int(document["index"]),
            band=str(document["band"]),
            model=str(document["model"]),
            scheduled_at_s=float(document["scheduled_at_s"]),
            lateness_s=float(document["lateness_s"]),
            status=None if document["status"] is None else int(document["status"]),
            error=None if error is None else ErrorKind(error),
            ttft_s=_optional_float(document["ttft_s"]),
            tpot_s=_optional_float(document["tpot_s"]),
            e2e_s=_optional_float(document["e2e_s"]),
            output_tokens=int(document["output_tokens"]),
            backend_id=_optional_str(document["backend_id"]),
            retry_after=_optional_str(document["retry_after"]),
            error_code=_optional_str(document["error_code"]),
            # Absent from results saved before it was recorded.
            error_json=_optional_bool(document.get("error_json")),
        )


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """A whole replay: every request's result (in trace order) and the generator's health.

    `loop_lag_*` is how late a 10 ms sleep woke up on the generator's event loop;
    `send_lateness_p99_s` is the 99th percentile of the requests' `lateness_s`. `saturated`
    is True when either p99 went over `replay.SATURATION_THRESHOLD_S` (50 ms): the
    generator itself, not the system under test, was then the bottleneck and the run's
    latencies are suspect. `cpu_s` is the process CPU time the replay used.
    `started_at_unix` is the wall-clock time of the trace's offset 0, to line the run up
    with other time series (pod metrics, Envoy stats); every other time is relative to it.
    """

    url: str
    trace_seed: int
    started_at_unix: float
    time_scale: float
    max_in_flight: int
    duration_s: float
    results: tuple[RequestResult, ...]
    loop_lag_p50_s: float
    loop_lag_p99_s: float
    loop_lag_max_s: float
    send_lateness_p99_s: float
    saturated: bool
    cpu_s: float
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dropped_by_client(self) -> int:
        return sum(1 for r in self.results if r.error is ErrorKind.DROPPED_BY_CLIENT)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "url": self.url,
            "trace_seed": self.trace_seed,
            "started_at_unix": self.started_at_unix,
            "time_scale": self.time_scale,
            "max_in_flight": self.max_in_flight,
            "duration_s": self.duration_s,
            "loop_lag_p50_s": self.loop_lag_p50_s,
            "loop_lag_p99_s": self.loop_lag_p99_s,
            "loop_lag_max_s": self.loop_lag_max_s,
            "send_lateness_p99_s": self.send_lateness_p99_s,
            "saturated": self.saturated,
            "cpu_s": self.cpu_s,
            "metadata": dict(self.metadata),
            "results": [r.to_json() for r in self.results],
        }

    @classmethod
    def from_json(cls, document: Any, *, source: str = "results") -> ReplayResult:
        """Parse what `to_json` produced; raises TraceFormatError."""
        if not isinstance(document, dict) or document.get("format") != _FORMAT:
            raise TraceFormatError(f"{source}: not replay results (format is not {_FORMAT!r})")
        if document.get("version") != _VERSION:
            raise TraceFormatError(
                f"{source}: results version {document.get('version')!r}, expected {_VERSION}"
            )
        try:
            return cls(
                url=str(document["url"]),
                trace_seed=int(document["trace_seed"]),
                started_at_unix=float(document["started_at_unix"]),
                time_scale=float(document["time_scale"]),
                max_in_flight=int(document["max_in_flight"]),
                duration_s=float(document["duration_s"]),
                results=tuple(RequestResult.from_json(r) for r in document["results"]),
                loop_lag_p50_s=float(document["loop_lag_p50_s"]),
                loop_lag_p99_s=float(document["loop_lag_p99_s"]),
                loop_lag_max_s=float(document["loop_lag_max_s"]),
                send_lateness_p99_s=float(document["send_lateness_p99_s"]),
                saturated=bool(document["saturated"]),
                cpu_s=float(document["cpu_s"]),
                metadata=dict(document["metadata"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{source}: bad results: {exc!r}") from exc

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    def save(self, path: Path) -> None:
        """Write the results to `path` as one JSON document."""
        path.write_text(self.dumps(), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> ReplayResult:
        """Read results written by `save`; raises TraceFormatError."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TraceFormatError(f"{path}: cannot read: {exc.strerror}") from exc
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise TraceFormatError(f"{path}: not JSON: {exc}") from exc
        return cls.from_json(document, source=str(path))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)
