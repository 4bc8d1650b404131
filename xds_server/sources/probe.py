"""A probe request to a pod the server suspects, or judged stalled or failing (verdicts.py).

A judged pod is out of rotation, so no client's request can tell that it serves again:
the server asks it itself, with the smallest request that goes through the same path as
a client's: a streamed completion of two tokens. It must finish (`data: [DONE]`) within
the timeout; an answer that starts and stops is the fault the verdict was for.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

__all__ = ["ProbeFailure", "probe_completion"]

# The most bytes of a probe's answer read: two tokens' events are a few hundred.
_MAX_ANSWER_BYTES = 64 << 10


@dataclass(frozen=True)
class ProbeFailure:
    """Why a probe was not served: `timed_out` (no complete answer in time: a stalled
    pod), else an error (a status, a reset, a refused connection: a failing one);
    `started`: its answer's first chunk came (a generation that began and stopped, where
    one that never began may be waiting behind a long queue)."""

    detail: str
    timed_out: bool = False
    started: bool = False

    def __str__(self) -> str:
        return self.detail


async def probe_completion(
    host: str, port: int, model: str, *, timeout_s: float, first_chunk_s: float | None = None
) -> ProbeFailure | None:
    """None when the pod at host:port served a two-token streamed completion of `model`
    within `timeout_s`, else why not. With `first_chunk_s`, the answer's first chunk may
    take that long (the probe waits behind the pod's queue like any request) and the
    rest `timeout_s` from there: a busy pod passes, one that stops after a chunk does not."""
    body = {"model": model, "prompt": "ping", "max_tokens": 2, "stream": True}
    url = f"http://{host}:{port}/v1/completions"
    waited = first_chunk_s if first_chunk_s is not None else timeout_s
    answer = b""
    try:
        async with asyncio.timeout(waited) as deadline, aiohttp.ClientSession() as session:
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    return ProbeFailure(f"HTTP {response.status}")
                async for chunk in response.content.iter_any():
                    if not answer and first_chunk_s is not None:
                        deadline.reschedule(asyncio.get_running_loop().time() + timeout_s)
                    answer += chunk
                    if b"[DONE]" in answer:
                        return None
                    if len(answer) > _MAX_ANSWER_BYTES:
                        return ProbeFailure("an answer longer than two tokens")
                return ProbeFailure("the stream ended without [DONE]")
    except TimeoutError:
        if answer:
            detail = f"no complete answer within {timeout_s:g} s of its first chunk"
        else:
            detail = f"no answer began within {waited:g} s"
        return ProbeFailure(detail, timed_out=True, started=bool(answer))
    except aiohttp.ClientError as error:
        return ProbeFailure(f"{type(error).__name__}: {error}")
