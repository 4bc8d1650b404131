"""`xds-server run` as a separate process: a server replica that can be killed like a pod.

Replicas that share their Envoys' load (xds_server/peering) must be separate processes to
be tested honestly: each with its own event loop, ports and clock, linked only over the
network, and one of them killed (SIGKILL, no goodbye) while the others carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

__all__ = ["ServerProcess", "free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """One `python -m xds_server run --config CONFIG` on loopback ports of its own:
    plaintext, or mutual TLS with `tls_args` (`--tls-cert ...`).

    Use `async with`: entering starts it and waits until it serves a snapshot
    (/readyz); leaving stops it (SIGTERM, then SIGKILL). `kill` ends it at once.
    """

    def __init__(
        self,
        config: Path,
        *,
        replica: str,
        xds_port: int | None = None,
        peers: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        tls_args: Sequence[str] = (),
        log_level: str = "warning",
    ) -> None:
        self.config = config
        self.replica = replica
        self.xds_port = xds_port or free_port()
        self.admin_port = free_port()
        self.debug_port = free_port()
        self.peers = tuple(peers)
        self._extra_args = tuple(extra_args)
        self._tls_args = tuple(tls_args)
        self._log_level = log_level
        self._process: asyncio.subprocess.Process | None = None

    @property
    def xds_address(self) -> str:
        return f"127.0.0.1:{self.xds_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def pid(self) -> int:
        assert self._process is not None, "not started"
        return self._process.pid

    def rss_bytes(self) -> int:
        """The process's resident memory now (Linux /proc)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for process {self.pid}")

    @property
    def debug_url(self) -> str:
        return f"http://127.0.0.1:{self.debug_port}"

    async def __aenter__(self) -> ServerProcess:
        args = [
            "-m", "xds_server", "--log-level", self._log_level,
            "run", "--config", str(self.config), "--replica", self.replica,
            "--xds-port", str(self.xds_port), "--admin-port", str(self.admin_port),
            "--debug-port", str(self.debug_port),
            *(arg for peer in self.peers for arg in ("--peer", peer)),
            *(self._tls_args or ("--plaintext",)),
            *self._extra_args,
        ]  # fmt: skip
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, *args, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        try:
            await self.wait_ready()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def wait_ready(self, within_s: float = 60.0) -> None:
        """Wait until the server has a snapshot; raises if it exits or takes too long."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while True:
                if self._process is None or self._process.returncode is not None:
                    raise RuntimeError(f"xds-server {self.replica} exited before it was ready")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(f"{self.admin_url}/readyz") as response:
                        if response.status == 200:
                            return
                if loop.time() > deadline:
                    raise TimeoutError(f"xds-server {self.replica} not ready in {within_s} s")
                await asyncio.sleep(0.1)

    async def get_json(self, path: str) -> Any:
        """GET `path` of the debug views (/debug/...), as JSON."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(f"{self.debug_url}{path}") as response:
                response.raise_for_status()
                return await response.json()

    async def kill(self) -> None:
        """SIGKILL: every stream cut at once, as when a node dies."""
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGKILL)
            await self._process.wait()

    async def stop(self) -> None:
        """SIGTERM, and SIGKILL if it has not exited within 10 s."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            await self.kill()
