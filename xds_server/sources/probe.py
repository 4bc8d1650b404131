"""A probe request to a pod the server judged stalled or failing (verdicts.py).

The pod is out of rotation, so no client's request can tell that it serves again: the
server asks it itself, with the smallest request that goes through the same path as a
client's: a streamed completion of two tokens. It must finish (`data: [DONE]`) within the
timeout; an answer that starts and stops is the fault the verdict was for.
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
    pod), else an error (a status, a reset, a refused connection: a failing one)."""

    detail: str
    timed_out: bool = False

    def __str__(self) -> str:
        return self.detail


async def probe_completion(
    host: str, port: int, model: str, *, timeout_s: float
) -> ProbeFailure | None:
    """None when the pod at host:port served a two-token streamed completion of `model`
    within `timeout_s`, else why not."""
    body = {"model": model, "prompt": "ping", "max_tokens": 2, "stream": True}
    url = f"http://{host}:{port}/v1/completions"
    try:
        async with asyncio.timeout(timeout_s), aiohttp.ClientSession() as session:
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    return ProbeFailure(f"HTTP {response.status}")
                answer = b""
                async for chunk in response.content.iter_any():
                    answer += chunk
                    if b"[DONE]" in answer:
                        return None
                    if len(answer) > _MAX_ANSWER_BYTES:
                        return ProbeFailure("an answer longer than two tokens")
                return ProbeFailure("the stream ended without [DONE]")
    except TimeoutError:
        return ProbeFailure(f"no complete answer within {timeout_s:g} s", timed_out=True)
    except aiohttp.ClientError as error:
        return ProbeFailure(f"{type(error).__name__}: {error}")
