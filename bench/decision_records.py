"""Decisions recorded from the benchmark's scenarios, to replay against the policy.

`python -m bench.record_decisions` runs scenarios with the project's policy and keeps every
call of `Decider.steps`: its inputs, the memory it was given, and what it returned. The
replay test (tests/policy/test_decision_replay.py) decides each recorded input again and
compares: a refactor of the policy must give the same decision for every one of them.

The records are JSON (gzipped), not pickles, so that they outlive the policy's own types
moving between modules: `encode` turns any of the decision's values into plain JSON,
`decode_inputs` and `decode_memory` build today's types from them.
"""

from __future__ import annotations

import dataclasses
import enum
import gzip
import json
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

from xds_server.config import RoutingConfig
from xds_server.policy.admission import BandLoad
from xds_server.policy.affinity import AffinityMemory
from xds_server.policy.decision import DecisionInputs, FleetLoad, PolicyMemory, PoolLoad, PoolMemory
from xds_server.policy.homes import HomeMemory
from xds_server.policy.shares import EnvoyDemand
from xds_server.policy.signals import PodSignals

__all__ = ["Recording", "decode_inputs", "decode_memory", "encode", "load", "save"]

FORMAT = 1


def encode(value: Any, *, leave_out: Set[str] = frozenset()) -> Any:
    """`value` as plain JSON: dataclasses as objects (without the fields in `leave_out`,
    at any depth: fields added since a recording), sets sorted, enums by value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: encode(getattr(value, f.name), leave_out=leave_out)
            for f in dataclasses.fields(value)
            if f.name not in leave_out
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): encode(v, leave_out=leave_out) for k, v in value.items()}
    if isinstance(value, frozenset | set):
        return sorted(encode(v, leave_out=leave_out) for v in value)
    if isinstance(value, tuple | list):
        return [encode(v, leave_out=leave_out) for v in value]
    return value


def _signals(raw: Mapping[str, Any]) -> PodSignals:
    fields = {f.name for f in dataclasses.fields(PodSignals)}
    values: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in fields
    }
    return PodSignals(**values)


def _demands(raw: Mapping[Any, Any]) -> dict[Any, EnvoyDemand]:
    return {band: EnvoyDemand(**demand) for band, demand in raw.items()}


def _band_load(raw: Mapping[str, Any]) -> BandLoad:
    return BandLoad(
        in_flight=dict(raw["in_flight"]),
        completions_per_s=raw["completions_per_s"],
        issued_per_s=dict(raw["issued_per_s"]),
        by_envoy={node: _demands(bands) for node, bands in raw["by_envoy"].items()},
        lanes_by_envoy={
            node: {band: _demands(lanes) for band, lanes in bands.items()}
            for node, bands in raw["lanes_by_envoy"].items()
        },
    )


def _pool_load(raw: Mapping[str, Any]) -> PoolLoad:
    return PoolLoad(
        bands=_band_load(raw["bands"]),
        long_prompts=dict(raw["long_prompts"]),
        verdicts=dict(raw["verdicts"]),
        slowness=dict(raw["slowness"]),
    )


def decode_inputs(raw: Mapping[str, Any], config: RoutingConfig) -> DecisionInputs:
    signals = raw["signals"]
    load = raw["load"]
    return DecisionInputs(
        config=config,
        signals=None if signals is None else {k: _signals(s) for k, s in signals.items()},
        load=None
        if load is None
        else FleetLoad(
            pools={name: _pool_load(p) for name, p in load["pools"].items()},
            reserved=load["reserved"],
        ),
    )


def _homes(raw: Mapping[str, Any] | None) -> HomeMemory:
    """A pool's key-homes memory (recordings before it have none)."""
    if raw is None:
        return HomeMemory()
    return HomeMemory(
        factors=dict(raw["factors"]),
        load=dict(raw["load"]),
        spills=dict(raw["spills"]),
        samples=raw["samples"],
        ratios=dict(raw["ratios"]),
    )


def decode_memory(raw: Mapping[str, Any]) -> PolicyMemory:
    return PolicyMemory(
        pools={
            name: PoolMemory(
                scores=dict(p["scores"]),
                placement={k: tuple(v) for k, v in p["placement"].items()},
                adapter_activity=dict(p["adapter_activity"]),
                spilled=frozenset(p["spilled"]),
                homes=_homes(p.get("homes")),
                affinity=AffinityMemory(**p.get("affinity", {})),
            )
            for name, p in raw["pools"].items()
        }
    )


@dataclasses.dataclass
class Recording:
    """Routing configs (each once) and decisions, each naming its config by index."""

    configs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    decisions: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def config_index(self, config: RoutingConfig) -> int:
        dumped = config.model_dump(mode="json")
        if dumped not in self.configs:
            self.configs.append(dumped)
        return self.configs.index(dumped)


def save(recording: Recording, path: Path) -> None:
    document = {"format": FORMAT, **dataclasses.asdict(recording)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as out:
        json.dump(document, out, separators=(",", ":"), sort_keys=True)


def load(path: Path) -> Recording:
    with gzip.open(path, "rt", encoding="utf-8") as source:
        document = json.load(source)
    if document.get("format") != FORMAT:
        raise ValueError(f"{path}: decision records of format {document.get('format')!r}")
    return Recording(configs=document["configs"], decisions=document["decisions"])
