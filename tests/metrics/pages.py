"""Metrics pages for the tests: every simulated engine's, from an engine with work in it."""

from __future__ import annotations

import re
import time

from prometheus_client.parser import text_string_to_metric_families

from llm_sim.engine import Engine, EngineRequest, EngineState
from llm_sim.metrics_text import Flavour, HttpStats, render_metrics
from llm_sim.profiles import H100
from xds_server.metrics.exposition import SUFFIXES, Sample

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTERS = ("sql-lora", "chat-lora")


def busy_engine(*, lora: bool = True) -> Engine:
    """An engine mid-work: some requests finished, some running, some waiting, a shared
    prefix cached, and (with `lora`) adapters seen in several running/waiting sets."""
    engine = Engine(H100, seed=7)
    shared = tuple(f"s{k}" for k in range(64))
    adapters = (*ADAPTERS, None) if lora else (None,)
    for i in range(60):
        prompt = shared + tuple(f"p{i}-{k}" for k in range(40 + 30 * (i % 5)))
        engine.add(
            EngineRequest(
                request_id=f"r{i}",
                prompt=prompt,
                max_tokens=6 + (i % 7) * 5,
                adapter=adapters[i % len(adapters)] if i < 30 else None,
                arrival=0.0,
            )
        )
    now = 0.0
    for _ in range(8):  # two LoRA label sets by now; some requests still wait
        now = engine.step(now).end
    return engine


def http_stats() -> HttpStats:
    http = HttpStats()
    for handler in ("/v1/chat/completions", "/v1/completions", "/metrics", "/health"):
        for status in (200, 200, 404):
            http.observe(
                handler=handler,
                method="POST" if handler.startswith("/v1") else "GET",
                status=status,
                duration_s=0.02 * (1 + status % 7),
                request_bytes=321,
                response_bytes=4567,
            )
    return http


def page(engine: Engine, flavour: Flavour, *, lora: bool = True) -> str:
    return render_metrics(
        engine,
        flavour=flavour,
        model_name=MODEL,
        lora_enabled=lora,
        unix_offset=time.time() - engine.state().time,
        http=http_stats(),
    )


def state(engine: Engine) -> EngineState:
    return engine.state()


def belongs(name: str, families: frozenset[str]) -> bool:
    """The selection rule of `parse_samples`, written plainly."""
    return name in families or any(
        name.endswith(suffix) and name[: -len(suffix)] in families for suffix in SUFFIXES
    )


def reference_samples(text: str, families: frozenset[str] | None = None) -> list[Sample]:
    """prometheus-client's full parse, samples named as written, kept if `families` wants
    them (all when None).

    prometheus-client renames the samples of a counter whose TYPE line lacks `_total`
    (TGI's `tgi_queue_size`-style counters) to end in `_total`; that is undone here.
    """
    out: list[Sample] = []
    for family in text_string_to_metric_families(text):
        unmunge = family.type == "counter" and bool(
            re.search(rf"^# TYPE {re.escape(family.name)} counter$", text, re.MULTILINE)
        )
        for sample in family.samples:
            name = sample.name[: -len("_total")] if unmunge else sample.name
            if families is None or belongs(name, families):
                out.append(Sample(name, dict(sample.labels), float(sample.value)))
    return out


def comparable(samples: list[Sample]) -> list[tuple[str, dict[str, str], float | str]]:
    """NaN equals NaN here."""
    return [(s.name, dict(s.labels), "NaN" if s.value != s.value else s.value) for s in samples]
