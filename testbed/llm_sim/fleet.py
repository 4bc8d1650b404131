"""Many simulated pods in one process, started and stopped together.

A benchmark scenario is "2 H100s and 2 A10Gs" or "8 identical pods": one object that
starts them all (concurrently), names them, and stops every one of them on exit, even when
one fails to start, so a scenario never leaks a listening socket or a step-loop task.

Mutable state: `state` and `_started` (the pods to stop).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

from llm_sim.metrics_text import Flavour
from llm_sim.pod import DEFAULT_MODEL, SimulatedPod
from llm_sim.profiles import HardwareProfile

__all__ = ["Fleet", "FleetState", "PodSpec"]


@dataclass(frozen=True, kw_only=True)
class PodSpec:
    """One pod of a fleet: its name, hardware, metrics flavour and LoRA adapters."""

    name: str
    profile: HardwareProfile
    flavour: Flavour = Flavour.VLLM
    adapters: tuple[str, ...] = ()


class FleetState(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


def _spec(item: PodSpec | tuple[str, HardwareProfile, Flavour, Sequence[str]]) -> PodSpec:
    if isinstance(item, PodSpec):
        return item
    name, profile, flavour, adapters = item
    return PodSpec(name=name, profile=profile, flavour=flavour, adapters=tuple(adapters))


class Fleet:
    """Simulated pods for `specs` (a `PodSpec` or a `(name, profile, flavour, adapters)`
    tuple each), as an async context manager.

    Every pod serves `model` (plus its adapters) with the same `stream_interval`; pod i's
    output words are seeded with `seed + i`.
    """

    def __init__(
        self,
        specs: Iterable[PodSpec | tuple[str, HardwareProfile, Flavour, Sequence[str]]],
        *,
        model: str = DEFAULT_MODEL,
        stream_interval: int = 1,
        seed: int = 0,
        host: str = "127.0.0.1",
    ) -> None:
        self.specs = tuple(_spec(item) for item in specs)
        names = [spec.name for spec in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"Pod names in a fleet must be unique: {names}.")
        self.state = FleetState.UNOPENED
        self.pods = tuple(
            SimulatedPod(
                spec.name,
                profile=spec.profile,
                model=model,
                adapters=spec.adapters,
                flavour=spec.flavour,
                stream_interval=stream_interval,
                seed=seed + index,
                host=host,
            )
            for index, spec in enumerate(self.specs)
        )
        self._by_name = {pod.name: pod for pod in self.pods}
        self._started: list[SimulatedPod] = []

    def __repr__(self) -> str:
        return f"<Fleet pods={len(self.pods)} state={self.state.value}>"

    async def __aenter__(self) -> Fleet:
        if self.state is not FleetState.UNOPENED:
            raise RuntimeError(
                f"Cannot start a fleet that is {self.state.value}; a fleet starts only once."
            )
        self.state = FleetState.OPEN
        try:
            entered = await asyncio.gather(
                *(pod.__aenter__() for pod in self.pods), return_exceptions=True
            )
            for pod, result in zip(self.pods, entered, strict=True):
                if not isinstance(result, BaseException):
                    self._started.append(pod)
            for result in entered:
                if isinstance(result, BaseException):
                    raise result
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.state is FleetState.CLOSED:
            return
        self.state = FleetState.CLOSED
        stopping = [pod.__aexit__(None, None, None) for pod in self._started]
        await asyncio.shield(asyncio.gather(*stopping))

    def __getitem__(self, name: str) -> SimulatedPod:
        return self._by_name[name]

    def __iter__(self) -> Iterator[SimulatedPod]:
        return iter(self.pods)

    def __len__(self) -> int:
        return len(self.pods)

    def endpoints(self) -> list[tuple[str, str, int]]:
        """`(name, host, port)` of every pod, in spec order (for a routing config)."""
        return [(pod.name, pod.host, pod.port) for pod in self.pods]
