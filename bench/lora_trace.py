"""Evidence for LoRA scenarios: where each adapter was advertised and where it ran.

Beside a replay, `AdapterSampler` samples every `INTERVAL_S` each pod's engine (the
adapters of its running and of its waiting requests, and how many of each) and, for the
project, the adapters the server's current decision advertises on it (its Envoy subsets).
The samples are saved beside the trace with the per-request results (which carry the pod
that served each request), so that after a run one can tell which adapter's requests
waited, on which pod, and what that pod held and ran meanwhile: an adapter waiting on a
pod whose slots other adapters keep busy shows as waiting there and absent from running.

Mutable state: `_samples`, appended to while `running()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from llm_sim.fleet import Fleet

__all__ = ["AdapterSampler"]


class AdapterSampler:
    """Samples `fleet`'s engines, and with `placement` (the adapters each pod is advertised
    with, by pod name) the server's placement, every `INTERVAL_S` while running."""

    INTERVAL_S = 0.1

    def __init__(
        self,
        fleet: Fleet,
        *,
        placement: Callable[[], Mapping[str, tuple[str, ...]]] | None = None,
    ) -> None:
        self._fleet = fleet
        self._placement = placement
        self._samples: list[tuple[float, dict[str, dict[str, Any]]]] = []

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async def sample() -> None:
            while True:
                self._samples.append((time.time(), self._sample()))
                await asyncio.sleep(self.INTERVAL_S)

        task = asyncio.create_task(sample())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _sample(self) -> dict[str, dict[str, Any]]:
        advertised = dict(self._placement()) if self._placement is not None else {}
        pods: dict[str, dict[str, Any]] = {}
        for pod in self._fleet:
            engine = pod.state_snapshot().engine
            pods[pod.name] = {
                "advertised": list(advertised.get(pod.name, ())),
                "running_adapters": list(engine.running_adapters),
                "waiting_adapters": list(engine.waiting_adapters),
                "running": engine.num_running,
                "waiting": engine.num_waiting,
            }
        return pods

    def save(self, path: Path, *, started_at_unix: float) -> None:
        """Every sample as [seconds since `started_at_unix` (the trace's offset 0), {pod:
        {advertised, running_adapters, waiting_adapters, running, waiting}}], as JSON."""
        document = {
            "interval_s": self.INTERVAL_S,
            "samples": [[round(t - started_at_unix, 3), pods] for t, pods in self._samples],
        }
        path.write_text(json.dumps(document))
