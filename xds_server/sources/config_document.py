"""A routing document on its way in: parsed away from the event loop, then checked.

Parsing runs in a child process, not in a thread. Measured on this code (2 cores), a
1 MiB document parsed by `asyncio.to_thread` stalled the event loop for up to 257 ms
(libyaml) and 359 ms (pure-Python loader), and ADS, LRS, the scrapes and the admin server
all share that loop: a thread hands the GIL back only between bytecodes, and the cyclic
garbage collector, set off by the parse's hundreds of thousands of objects, stops every
thread while it walks them. A child costs the loop a pipe and a process exit; it is killed
when it overruns `timeout_s`; and a parser that crashes or runs out of memory on a hostile
document takes only itself down.

The child runs `parse_config`, whose `ParseLimits` bound the work (bytes, aliases and what
they expand to, depth), with the garbage collector off (the limits bound its memory, and
it exits at once), and writes the pickled `RoutingConfig`, or `ConfigError`, to stdout.
Unpickling is safe here: the bytes come from our own child, and whatever the document
said, they are a validated RoutingConfig or a ConfigError. A child starts in about 0.2 s
(Python and pydantic), once per changed document.

A config can leave a pool without endpoints. One that takes away the last of a pool's
listed `endpoints` is refused (`refuse_emptied_pools`, unless the pool says `allow_empty`):
every request for its models would get 503, and an edit that drops a list by mistake is
likelier than one that means it. Any other such config is accepted; `warn_empty_pools`
says so (log and metric) and returns the warning for the source to record as an Event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import pickle
import sys
from pathlib import Path

from xds_server.config import ParseLimits, RoutingConfig, parse_config
from xds_server.errors import ConfigError
from xds_server.telemetry import Telemetry

__all__ = [
    "ChildParser",
    "PARSE_TIMEOUT_S",
    "POOL_WITHOUT_ENDPOINTS",
    "emptied_pools",
    "parse_in_child",
    "pools_without_endpoints",
    "refuse_emptied_pools",
    "warn_empty_pools",
]

logger = logging.getLogger(__name__)

# The longest a parse may take: a 1 MiB config takes about 1 s in the child (cold start
# included) on an idle core.
PARSE_TIMEOUT_S = 10.0

# The `reason` of xds_config_warnings_total (and of the Kubernetes Event) for a pool that
# the accepted config leaves without endpoints.
POOL_WITHOUT_ENDPOINTS = "pool_without_endpoints"

_LIMITS = ParseLimits()

# The directory `xds_server` is imported from: the child imports the same code.
_IMPORT_ROOT = str(Path(__file__).resolve().parents[2])
_CHILD = "from xds_server.sources.config_document import _child_main; _child_main()"


async def parse_in_child(
    document: str | bytes,
    *,
    source: str,
    limits: ParseLimits = _LIMITS,
    timeout_s: float = PARSE_TIMEOUT_S,
) -> RoutingConfig:
    """`parse_config` in a child process (module docstring), killed after `timeout_s`.

    Raises ConfigError: the document's own problems, or that it was over a limit, took too
    long, or that the parser could not run.
    """
    return await ChildParser(keep_warm=False).parse(
        document, source=source, limits=limits, timeout_s=timeout_s
    )


class ChildParser:
    """Parses routing documents in child processes, with the next child started ahead.

    A child spends about 0.2 s starting (Python, pydantic, the config model) before it
    reads a byte; with `keep_warm` one is started as soon as the last is taken, so a
    changed document waits only for its own parse (a 10,000-endpoint config: 0.25 s cold,
    about 0.06 s warm). The spare waits on its stdin and exits when that closes, so it
    never outlives this process. `aclose` ends it.

    Mutable state: the spare child (a task starting it), if any.
    """

    def __init__(self, *, keep_warm: bool = True) -> None:
        self._keep_warm = keep_warm
        self._spare: asyncio.Task[asyncio.subprocess.Process] | None = None

    async def parse(
        self,
        document: str | bytes,
        *,
        source: str,
        limits: ParseLimits = _LIMITS,
        timeout_s: float = PARSE_TIMEOUT_S,
    ) -> RoutingConfig:
        """As `parse_in_child`."""
        data = document.encode(errors="surrogatepass") if isinstance(document, str) else document
        limits.check_size(len(data), source=source)
        spare, self._spare = self._spare, None
        try:
            child = await (spare if spare is not None else _start_child())
        except OSError as exc:
            raise ConfigError(f"{source}: cannot start the config parser: {exc}") from exc
        if self._keep_warm:
            self._spare = asyncio.create_task(_start_child(), name="config-parser-spare")
        header = json.dumps({"source": source, "limits": dataclasses.asdict(limits)}).encode()
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await child.communicate(header + b"\n" + data)
        except TimeoutError:
            raise ConfigError(
                f"{source}: refused: parsing took longer than {timeout_s:g} s"
            ) from None
        finally:
            await _reap(child)
        if child.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [
                f"exit status {child.returncode}"
            ]
            raise ConfigError(f"{source}: refused: the config parser failed ({last[0]})")
        try:
            # In a thread: a 1 MiB config is ~10^5 objects (60 ms of unpickling, measured).
            result = await asyncio.to_thread(pickle.loads, out)
        except Exception as exc:
            raise ConfigError(
                f"{source}: the config parser answered nothing usable ({exc!r})"
            ) from exc
        if isinstance(result, ConfigError):
            raise result
        if not isinstance(result, RoutingConfig):
            raise ConfigError(f"{source}: the config parser answered a {type(result).__name__}")
        return result

    async def aclose(self) -> None:
        """End the spare child, if one was started."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        try:
            child = await spare
        except OSError:
            return
        await _reap(child)


async def _start_child() -> asyncio.subprocess.Process:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (_IMPORT_ROOT, env.get("PYTHONPATH"))))
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=_IMPORT_ROOT,
        env=env,
    )


async def _reap(child: asyncio.subprocess.Process) -> None:
    """Kill `child` if it still runs, and wait for it, even when cancelled (the server
    stops while a parse runs)."""
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
    await asyncio.shield(child.wait())


def _child_main() -> None:
    """The child's whole life: stdin is a JSON line (the source and the limits), then the
    document; stdout gets the pickled RoutingConfig or ConfigError. The imports are done
    before stdin is read, so a spare child waits ready."""
    gc.disable()
    header, _, document = sys.stdin.buffer.read().partition(b"\n")
    result: RoutingConfig | ConfigError
    try:
        settings = json.loads(header)
        source, limits = str(settings["source"]), ParseLimits(**settings["limits"])
    except (ValueError, KeyError, TypeError):
        result = ConfigError("config parser: no document was sent")
    else:
        try:
            result = parse_config(document, source=source, limits=limits)
        except ConfigError as exc:
            result = ConfigError(str(exc))
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.flush()


def pools_without_endpoints(config: RoutingConfig, *, selectors_followed: bool) -> tuple[str, ...]:
    """The names of the pools `config` gives no endpoint: none listed, and no `selector`
    (or one that nothing follows: `selectors_followed` is False without Kubernetes).

    On Kubernetes a pool with a selector is not counted: its pods come and go (none are
    Ready for a moment in a rollout), and /debug/config shows what each selector finds.
    """
    return tuple(
        pool.name
        for pool in config.pools
        if not pool.endpoints and (pool.selector is None or not selectors_followed)
    )


def emptied_pools(
    before: RoutingConfig | None, config: RoutingConfig, *, selectors_followed: bool
) -> tuple[str, ...]:
    """The pools `config` would empty, in its order: those it leaves without endpoints
    (`pools_without_endpoints`) that listed at least one endpoint in `before`, the config
    last accepted from the same source, unless `config` gives them `allow_empty`.

    Only a list of `endpoints` that goes from some to none counts. Not counted: a pool new
    in `config` or one that listed none in `before` (it had nothing to lose; it is accepted
    with the warning, as before); a pool whose selector is followed (its pods come and go
    for good reasons, none Ready before the first rollout: /readyz and
    xds_pool_healthy_endpoints show it empty); a pool `config` removes (its models go with
    it); anything when `before` is None (the first config since the server started). On
    Kubernetes an InferencePool of the pool's name may still bring pods, but the document
    is judged alone: a pool that means to rely on one says `allow_empty`.
    """
    if before is None:
        return ()
    listed = {pool.name for pool in before.pools if pool.endpoints}
    allowed = {pool.name for pool in config.pools if pool.allow_empty}
    return tuple(
        name
        for name in pools_without_endpoints(config, selectors_followed=selectors_followed)
        if name in listed and name not in allowed
    )


def refuse_emptied_pools(
    before: RoutingConfig | None,
    config: RoutingConfig,
    *,
    source: str,
    selectors_followed: bool,
) -> None:
    """Raise ConfigError naming each pool `config` would empty (`emptied_pools`) and the
    endpoints it listed in `before`; return if it empties none. The source yields the error
    as it yields any refused document: the last good config stays in force."""
    emptied = emptied_pools(before, config, selectors_followed=selectors_followed)
    if not emptied:
        return
    assert before is not None  # emptied_pools empties nothing without it
    had = {pool.name: len(pool.endpoints) for pool in before.pools}
    names = ", ".join(f"{name!r} (had {had[name]})" for name in emptied)
    raise ConfigError(
        f"{source}: refused: it would leave {len(emptied)} pool(s) that listed endpoints"
        f" with none: {names}, and their models answered 503 no_healthy_upstream"
        " (`allow_empty: true` on a pool empties it on purpose)"
    )


def warn_empty_pools(
    config: RoutingConfig,
    *,
    source: str,
    selectors_followed: bool,
    telemetry: Telemetry | None = None,
) -> str | None:
    """Log, and count in xds_config_warnings_total, the pools `config` (just accepted) leaves
    without endpoints (`pools_without_endpoints`); return the warning, or None if there are
    none. The config is accepted all the same: such a pool's models get 503."""
    empty = pools_without_endpoints(config, selectors_followed=selectors_followed)
    if not empty:
        return None
    if telemetry is not None:
        telemetry.config_warnings.labels(POOL_WITHOUT_ENDPOINTS).inc(len(empty))
    names = ", ".join(repr(name) for name in empty)
    if selectors_followed:
        why = "no endpoints and no selector; only an InferencePool of the same name can add pods"
    else:
        why = "no endpoints (a selector is followed only on Kubernetes)"
    warning = (
        f"{source}: accepted, but {len(empty)} pool(s) have {why}: {names}. "
        "Their models are answered 503 no_healthy_upstream."
    )
    logger.warning("%s", warning)
    return warning
