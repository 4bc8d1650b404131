"""The open-loop replayer against a local SSE server: timing, measurements, refusals, errors."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from llm_sim.loadgen import (
    DEFAULT_BAND_HEADER,
    SESSION_HEADER,
    Constant,
    ErrorKind,
    HeadersFor,
    PromptPart,
    ReplayFailedError,
    ReplayResult,
    RequestClass,
    Trace,
    TraceRequest,
    TraceSpec,
    generate_trace,
    replay,
    run_replay_in_subprocess,
    summarize,
)
from tests.llm_sim.loadgen.fake_server import ACTION_HEADER, FakeServer

# Generous for a shared 2-core machine; the schedule itself is kept to about a millisecond.
ON_TIME_S = 0.05


def trace_at(
    times: Sequence[float], *, max_tokens: int = 4, stream: bool = True, band: str = "standard"
) -> Trace:
    """A trace with requests at exactly `times`, each 3 prompt words and `max_tokens`."""
    spec = TraceSpec(
        duration_s=max(times, default=0) + 1,
        rate_per_s=0,
        stream=stream,
        request_classes=(
            RequestClass(
                name="t", prompt_words=Constant(value=3), output_tokens=Constant(value=max_tokens)
            ),
        ),
    )
    requests = tuple(
        TraceRequest(
            index=i,
            at_s=t,
            model=spec.model,
            request_class="t",
            prompt_words=3,
            parts=(PromptPart("q", i, 3),),
            max_tokens=max_tokens,
            adapter=None,
            band="sheddable" if band == "sheddable" else "standard",
            session=f"s{i}",
            turn=1,
            prefix_group=None,
        )
        for i, t in enumerate(times)
    )
    return Trace(spec=spec, seed=0, requests=requests)


def actions(by_index: Mapping[int, str]) -> HeadersFor:
    def headers_for(request: TraceRequest) -> Mapping[str, str]:
        action = by_index.get(request.index)
        return {ACTION_HEADER: action} if action else {}

    return headers_for


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    async with FakeServer(first_token_delay=0.05, token_delay=0.02) as fake:
        yield fake


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_requests_go_out_on_schedule_even_when_the_server_is_slow() -> None:
    spec = TraceSpec(
        duration_s=1.0,
        rate_per_s=30,
        arrivals="gamma",
        burstiness_cv=0.2,
        request_classes=(
            RequestClass(name="t", prompt_words=Constant(value=4), output_tokens=Constant(value=6)),
        ),
    )
    trace = generate_trace(spec, seed=1)
    assert len(trace.requests) >= 20
    # Each response takes ~0.55 s while requests are due every ~33 ms: a closed-loop client
    # would fall behind at once.
    async with FakeServer(first_token_delay=0.3, token_delay=0.05) as slow:
        result = await replay(trace, url=slow.url, timeout_s=10, max_in_flight=100)
    assert [r.status for r in result.results] == [200] * len(trace.requests)
    assert slow.max_in_flight >= 10
    first = slow.arrivals[0].at
    for request, arrival in zip(trace.requests, slow.arrivals, strict=True):
        assert arrival.at - first == pytest.approx(
            request.at_s - trace.requests[0].at_s, abs=ON_TIME_S
        )
    assert max(r.lateness_s for r in result.results) < ON_TIME_S
    assert [r.scheduled_at_s for r in result.results] == [r.at_s for r in trace.requests]
    assert not result.saturated
    assert result.loop_lag_p99_s < ON_TIME_S
    assert result.duration_s == pytest.approx(trace.requests[-1].at_s + 0.55, abs=0.15)


async def test_time_scale_stretches_the_schedule(server: FakeServer) -> None:
    trace = trace_at([0.0, 0.1, 0.2])
    result = await replay(trace, url=server.url, timeout_s=5, max_in_flight=10, time_scale=2.0)
    assert [r.scheduled_at_s for r in result.results] == [0.0, 0.2, 0.4]
    gaps = [b.at - a.at for a, b in zip(server.arrivals, server.arrivals[1:], strict=False)]
    assert gaps == pytest.approx([0.2, 0.2], abs=ON_TIME_S)


async def test_measures_ttft_tpot_and_tokens_from_usage(server: FakeServer) -> None:
    trace = trace_at([0.0, 0.01, 0.02], max_tokens=5)
    result = await replay(
        trace, url=server.url, timeout_s=5, max_in_flight=10, headers_for=actions({2: "usage-lies"})
    )
    good, _, lied = result.results
    assert good.ok and good.status == 200 and good.error is None
    assert good.ttft_s is not None and good.e2e_s is not None and good.tpot_s is not None
    assert 0.05 <= good.ttft_s < good.e2e_s
    assert good.e2e_s == pytest.approx(0.05 + 4 * 0.02, abs=0.05)
    assert good.tpot_s == pytest.approx((good.e2e_s - good.ttft_s) / 4)
    assert good.tpot_s == pytest.approx(0.02, abs=0.01)
    assert good.output_tokens == 5
    assert good.backend_id == "b0"
    assert lied.output_tokens == 99, "the usage chunk wins over counting words"


async def test_sends_an_openai_request_with_session_and_band(server: FakeServer) -> None:
    trace = trace_at([0.0], max_tokens=3, band="sheddable")
    await replay(
        trace,
        url=server.url + "/",
        timeout_s=5,
        max_in_flight=10,
        prompt_salt="r1-",
        extra_body={"ignore_eos": True},
    )
    (arrival,) = server.arrivals
    assert arrival.body == {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [{"role": "user", "content": "r1-q0w0 r1-q0w1 r1-q0w2"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "s0",
        "ignore_eos": True,
    }
    assert arrival.headers[SESSION_HEADER] == "s0"
    assert arrival.headers[DEFAULT_BAND_HEADER] == "sheddable"


async def test_without_usage_counts_streamed_words(server: FakeServer) -> None:
    trace = trace_at([0.0], max_tokens=4)
    result = await replay(
        trace,
        url=server.url,
        timeout_s=5,
        max_in_flight=10,
        stream_options_usage=False,
        band_header="x-band",
        headers_for=actions({0: "two-words"}),
    )
    assert "stream_options" not in server.arrivals[0].body
    assert server.arrivals[0].headers["x-band"] == "standard"
    (only,) = result.results
    assert only.ok
    assert only.output_tokens == 5, "4 chunks, the first of two words"


async def test_non_streamed_requests(server: FakeServer) -> None:
    result = await replay(
        trace_at([0.0], max_tokens=7, stream=False), url=server.url, timeout_s=5, max_in_flight=1
    )
    (only,) = result.results
    assert server.arrivals[0].body["stream"] is False
    assert "stream_options" not in server.arrivals[0].body
    assert only.ok and only.output_tokens == 7
    assert only.ttft_s is None and only.tpot_s is None and only.e2e_s is not None


async def test_refusals_keep_their_status_retry_after_and_error_code(server: FakeServer) -> None:
    trace = trace_at([0.0, 0.0, 0.01, 0.02, 0.03])
    result = await replay(
        trace,
        url=server.url,
        timeout_s=5,
        max_in_flight=10,
        headers_for=actions({1: "429-retry", 2: "429", 3: "503"}),
    )
    ok, retry, no_retry, unavailable, ok_too = result.results
    assert (retry.status, retry.retry_after, retry.error_code) == (429, "2", "pool_saturated")
    assert (no_retry.status, no_retry.retry_after, no_retry.error_code) == (
        429,
        None,
        "rate_limited",
    )
    assert (unavailable.status, unavailable.error_code) == (503, None)
    # Envoy's own plain-text reply, as before the project made them OpenAI JSON.
    assert (retry.error_json, no_retry.error_json, unavailable.error_json) == (True, True, False)
    assert ok.error_json is None
    assert retry.backend_id == "b0" and not retry.ok and retry.ttft_s is None
    summary = summarize(result.results, duration_s=result.duration_s)
    assert summary.status_counts == {"200": 2, "429": 2, "503": 1}
    assert summary.retry_after_missing == 1
    assert summary.refused_by_band == {"standard": 3}
    assert summary.non_json_errors == 1
    assert ok.ok and ok_too.ok


async def test_transport_errors_are_recorded_by_kind(server: FakeServer) -> None:
    trace = trace_at([0.0, 0.0, 0.0, 0.0])
    result = await replay(
        trace,
        url=server.url,
        timeout_s=0.5,
        max_in_flight=10,
        headers_for=actions({0: "reset", 1: "no-done", 2: "hang"}),
    )
    reset, incomplete, timed_out, fine = result.results
    assert (reset.status, reset.error) == (200, ErrorKind.RESET)
    assert reset.ttft_s is not None, "the first token arrived before the reset"
    assert (incomplete.status, incomplete.error) == (200, ErrorKind.INCOMPLETE)
    assert incomplete.output_tokens == 4
    assert timed_out.error is ErrorKind.TIMEOUT
    assert timed_out.e2e_s == pytest.approx(0.5, abs=0.1)
    assert fine.ok
    refused = await replay(
        trace_at([0.0]), url=f"http://127.0.0.1:{free_port()}", timeout_s=2, max_in_flight=1
    )
    assert (refused.results[0].status, refused.results[0].error) == (None, ErrorKind.CONNECT)
    summary = summarize(result.results + refused.results, duration_s=1)
    # The timeout came before any headers; the reset and the missing [DONE] cut 200s that
    # had had their first tokens.
    assert summary.failed_before_headers == 2
    assert (summary.cut_streams, summary.cut_streams_without_tokens) == (2, 0)
    counts = summary.status_counts
    assert counts == {
        "200": 1,
        "error:connect": 1,
        "error:incomplete": 1,
        "error:reset": 1,
        "error:timeout": 1,
    }


async def test_max_in_flight_drops_instead_of_delaying() -> None:
    async with FakeServer(first_token_delay=0.3) as slow:
        result = await replay(
            trace_at([0.0, 0.0, 0.0, 0.0, 0.05, 0.5]), url=slow.url, timeout_s=5, max_in_flight=2
        )
    errors = [r.error for r in result.results]
    drop = ErrorKind.DROPPED_BY_CLIENT
    assert errors == [None, None, drop, drop, drop, None]
    assert result.dropped_by_client == 3
    assert len(slow.arrivals) == 3
    assert all(r.lateness_s < ON_TIME_S for r in result.results)
    counts = summarize(result.results, duration_s=result.duration_s).status_counts
    assert counts == {"200": 3, "error:dropped_by_client": 3}


async def test_a_blocked_generator_reports_itself_saturated(server: FakeServer) -> None:
    def slow_headers(request: TraceRequest) -> Mapping[str, str]:
        time.sleep(0.08)  # blocks the event loop, as an overloaded generator would
        return {}

    trace = trace_at([i * 0.01 for i in range(8)], max_tokens=1)
    result = await replay(
        trace, url=server.url, timeout_s=5, max_in_flight=10, headers_for=slow_headers
    )
    assert result.saturated
    assert result.send_lateness_p99_s > 0.3
    assert result.loop_lag_max_s > 0.05


async def test_results_round_trip_through_json(server: FakeServer, tmp_path: Path) -> None:
    result = await replay(
        trace_at([0.0, 0.01, 0.02]),
        url=server.url,
        timeout_s=5,
        max_in_flight=10,
        headers_for=actions({1: "429-retry"}),
    )
    assert ReplayResult.from_json(json.loads(result.dumps())) == result
    assert result.started_at_unix == pytest.approx(time.time(), abs=5)
    result.save(tmp_path / "results.json")
    assert ReplayResult.load(tmp_path / "results.json") == result


async def test_replay_in_a_subprocess(server: FakeServer, tmp_path: Path) -> None:
    trace = trace_at([0.0, 0.05, 0.1], max_tokens=3)
    trace.save(tmp_path / "trace.jsonl")
    result = await run_replay_in_subprocess(
        tmp_path / "trace.jsonl",
        url=server.url,
        timeout_s=5,
        max_in_flight=10,
        extra_headers={ACTION_HEADER: "429-retry"},
        band_header="x-band",
        results_path=tmp_path / "results.json",
    )
    assert [r.status for r in result.results] == [429, 429, 429]
    assert [r.retry_after for r in result.results] == ["2", "2", "2"]
    assert [a.headers["x-band"] for a in server.arrivals] == ["standard"] * 3
    assert result == ReplayResult.load(tmp_path / "results.json")
    assert result.trace_seed == 0 and not result.saturated


async def test_subprocess_failure_is_reported(tmp_path: Path) -> None:
    trace_at([0.0]).save(tmp_path / "trace.jsonl")
    with (tmp_path / "trace.jsonl").open("a") as file:
        file.write("{broken\n")
    with pytest.raises(ReplayFailedError, match=r"status 1.*bad request"):
        await run_replay_in_subprocess(
            tmp_path / "trace.jsonl", url="http://127.0.0.1:9", timeout_s=1, max_in_flight=1
        )


async def test_prefix_group_requests_carry_a_prompt_cache_key(server: FakeServer) -> None:
    base = trace_at([0.0, 0.01])
    grouped = tuple(
        dataclasses.replace(r, prefix_group=3 if r.index == 0 else None) for r in base.requests
    )
    await replay(
        Trace(spec=base.spec, seed=0, requests=grouped),
        url=server.url,
        timeout_s=5,
        max_in_flight=10,
    )
    bodies = sorted(server.arrivals, key=lambda a: a.body["user"])
    assert bodies[0].body["prompt_cache_key"] == "prefix-3"
    assert "prompt_cache_key" not in bodies[1].body


async def test_a_users_request_carries_user_without_a_session_header(server: FakeServer) -> None:
    base = trace_at([0.0, 0.01])
    users = tuple(
        dataclasses.replace(r, session=None, user="user-heavy-0" if r.index == 0 else None)
        for r in base.requests
    )
    await replay(
        Trace(spec=base.spec, seed=0, requests=users), url=server.url, timeout_s=5, max_in_flight=10
    )
    bodies = sorted(server.arrivals, key=lambda a: "user" in a.body)
    assert "user" not in bodies[0].body
    assert bodies[1].body["user"] == "user-heavy-0"
    assert all(SESSION_HEADER not in a.headers for a in server.arrivals)


async def test_cache_key_session_sends_the_prompt_cache_key_as_the_session_header(
    server: FakeServer, tmp_path: Path
) -> None:
    base = trace_at([0.0, 0.01, 0.02])
    # 0: a prefix group only; 1: a group and its own session; 2: neither.
    requests = (
        dataclasses.replace(base.requests[0], session=None, prefix_group=3),
        dataclasses.replace(base.requests[1], prefix_group=4),
        dataclasses.replace(base.requests[2], session=None),
    )
    Trace(spec=base.spec, seed=0, requests=requests).save(tmp_path / "trace.jsonl")
    sent: dict[bool, dict[str, tuple[dict[str, Any], str | None]]] = {}
    for enabled in (False, True):
        server.arrivals.clear()
        await run_replay_in_subprocess(
            tmp_path / "trace.jsonl",
            url=server.url,
            timeout_s=5,
            max_in_flight=10,
            cache_key_session=enabled,
        )
        sent[enabled] = {
            a.body["messages"][0]["content"]: (a.body, a.headers.get(SESSION_HEADER))
            for a in server.arrivals
        }
    by_index = [r.prompt_text() for r in requests]
    assert [sent[False][p][1] for p in by_index] == [None, "s1", None]
    assert [sent[True][p][1] for p in by_index] == ["prefix-3", "s1", None]
    # The bodies do not change.
    assert [sent[True][p][0] for p in by_index] == [sent[False][p][0] for p in by_index]
