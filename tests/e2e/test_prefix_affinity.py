"""Prompt-prefix keys through a real Envoy: a completion that names no session key sticks
to a pod by the first `balancing.prefix_key_bytes` bytes of its `prompt` (routes.py,
session affinity b').

One gateway (this server and a real Envoy) and four example backends serve the module;
the config's pool is not GPU-aware, so its endpoints stay as the config gives them. What
is shown is Envoy's own behaviour on the pushed config: json_to_metadata's reach (a
completions `prompt` string of at most 8 KiB; not a chat's messages), the namespace
printed as JSON and cut by the formatter, and the hash on the session cluster.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from xds_server.envoy import names
from xds_testbed import BACKEND_ID_HEADER, ExampleBackend
from xds_testbed.gateway import LocalGateway, run_local_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

PREFIX_BYTES = 48
# `{"prompt":"`: the JSON the routes print before the prompt's own bytes.
OPENING = '{"prompt":"'
# json_to_metadata's limit on a value (bytes of the decoded string), verified on 1.40.
VALUE_LIMIT = 8192


@dataclass
class Stack:
    gateway: LocalGateway
    backends: Sequence[ExampleBackend]
    http: aiohttp.ClientSession

    async def post(
        self, path: str, document: dict[str, Any], headers: dict[str, str] | None = None
    ) -> str:
        """One request, sent alone; returns the backend that served it, or `HTTP <status>`."""
        async with self.http.post(
            f"{self.gateway.url}{path}", json=document, headers=headers or {}
        ) as response:
            await response.read()
            backend = response.headers.get(BACKEND_ID_HEADER)
            return backend if response.status == 200 and backend else f"HTTP {response.status}"

    async def completions(self, prompts: Sequence[str], **body: Any) -> Counter[str]:
        """One completion per prompt, one after the other (bounded load stays out)."""
        served: Counter[str] = Counter()
        for prompt in prompts:
            served[
                await self.post("/v1/completions", {"model": "base", "prompt": prompt, **body})
            ] += 1
        return served

    def session_header(self, backend_id: str) -> str | None:
        backend = next(b for b in self.backends if b.backend_id == backend_id)
        return backend.last_headers.get(names.SESSION_HEADER)


def _document(backends: Sequence[ExampleBackend]) -> dict[str, Any]:
    endpoints = [{"address": b.host, "port": b.port} for b in backends]
    return {
        "listener": {"address": "127.0.0.1", "port": 0},
        "updates": {"debounce_s": 0.02, "max_delay_s": 0.2},
        "balancing": {"prefix_key_bytes": PREFIX_BYTES},
        "pools": [
            {
                "name": "llm",
                "models": ["base"],
                "session_affinity": True,
                "gpu_aware": False,
                "endpoints": endpoints,
            }
        ],
    }


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with AsyncExitStack() as exits:
        backends = [
            await exits.enter_async_context(ExampleBackend(backend_id=f"b{i}", tokens=2))
            for i in range(4)
        ]
        path = Path(tmp_path_factory.mktemp("prefix")) / "config.yaml"
        path.write_text(yaml.safe_dump(_document(backends)))
        gateway = await exits.enter_async_context(run_local_gateway(path, config_poll_s=0.05))
        http = await exits.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        )

        async def four_hosts() -> bool:
            for status in (await gateway.envoy.clusters_json())["cluster_statuses"]:
                if status["name"] in ("llm", "llm/session"):
                    if len(status.get("host_statuses", [])) != len(backends):
                        return False
            return True

        await gateway.envoy.wait_for(four_hosts, 10, what="have the pool's four hosts")
        yield Stack(gateway, backends, http)


def _prompts(prefix: str, count: int) -> list[str]:
    """`count` prompts that share `prefix` and differ after it."""
    return [f"{prefix} Question {i}: what is {i} squared?" for i in range(count)]


def _prefix(i: int) -> str:
    # Longer than PREFIX_BYTES, with a newline inside them: escaped as `\n` in the header.
    return f"System prompt {i:03d}.\nYou are a helpful assistant; answer briefly."


async def test_completions_sharing_a_prefix_stick_to_one_pod(stack: Stack) -> None:
    for i in range(3):
        served = await stack.completions(_prompts(_prefix(i), 12))
        assert len(served) == 1, (i, served)
        (backend,) = served
        # The hash key: the prompt's first PREFIX_BYTES bytes as JSON text.
        escaped = _prefix(i).replace("\n", "\\n")
        assert stack.session_header(backend) == (OPENING + escaped)[: len(OPENING) + PREFIX_BYTES]


async def test_different_prefixes_spread_over_the_pods(stack: Stack) -> None:
    homes: Counter[str] = Counter()
    for i in range(40):
        served = await stack.completions(_prompts(_prefix(i), 2))
        assert len(served) == 1, (i, served)
        homes.update(served.keys())
    assert set(homes) == {b.backend_id for b in stack.backends}, homes
    assert max(homes.values()) <= 20, homes


async def test_only_the_prefix_counts(stack: Stack) -> None:
    # Same first PREFIX_BYTES bytes, different afterwards: one pod.
    head = "x" * PREFIX_BYTES
    served = await stack.completions([head + tail for tail in ("a", "b" * 500, "\n c", "é")])
    assert len(served) == 1, served


async def test_explicit_keys_win_over_the_prompt(stack: Stack) -> None:
    prompt = _prompts(_prefix(7), 1)[0]
    # The same prompt under 40 `user`s: the keys decide, so it reaches more than one pod.
    spread: Counter[str] = Counter()
    for i in range(40):
        body = {"model": "base", "prompt": prompt, "user": f"conversation-{i}"}
        spread[await stack.post("/v1/completions", body)] += 1
    assert len(spread) > 1, spread
    # Different prompts under one client header: one pod, and the header is the client's.
    pinned: Counter[str] = Counter()
    for i in range(10):
        body = {"model": "base", "prompt": _prefix(i)}
        pinned[await stack.post("/v1/completions", body, {names.SESSION_HEADER: "pinned"})] += 1
    assert len(pinned) == 1, pinned
    assert stack.session_header(next(iter(pinned))) == "pinned"


async def test_unreachable_prompts_are_balanced_as_keyless(stack: Stack) -> None:
    # Over json_to_metadata's limit, a DEL in the prompt, a list of prompts, a chat: no key,
    # so the pool's least-request cluster spreads them, and each is served (no 503).
    cases: dict[str, list[dict[str, Any]]] = {
        "over the limit": [{"prompt": "p" * (VALUE_LIMIT + 1 + i)} for i in range(24)],
        "DEL": [{"prompt": f"same\x7fprefix {i}"} for i in range(24)],
        "a list": [{"prompt": ["same prefix", str(i)]} for i in range(24)],
    }
    for what, bodies in cases.items():
        served = Counter(
            [await stack.post("/v1/completions", {"model": "base", **b}) for b in bodies]
        )
        assert not any(k.startswith("HTTP") for k in served), (what, served)
        assert len(served) > 1, (what, served)
    chats = Counter(
        [
            await stack.post(
                "/v1/chat/completions",
                {"model": "base", "messages": [{"role": "system", "content": _prefix(1)}]},
            )
            for _ in range(24)
        ]
    )
    assert len(chats) > 1, chats
    # At the limit the prompt still keys: a prompt of exactly 8,192 bytes sticks.
    served = await stack.completions(["q" * VALUE_LIMIT] * 8)
    assert len(served) == 1, served
