"""The fleet benchmark's ADS clients: many Envoy-like xDS clients, in child processes.

Why not hundreds of real Envoys: each takes tens of megabytes and about a CPU-second to
start, so on a two-core machine the benchmark would measure Envoy. What the server sees of
an Envoy is its ADS stream, and these clients reproduce that part as Envoy 1.40 does it,
SotW or Delta (https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol):

- one stream per client on its own HTTP/2 connection (a local subchannel pool: gRPC would
  otherwise share one connection among channels to the same target), with node id
  `fleet-client-<i>` and the real Envoy's node cluster, so that all get its snapshot;
- RTDS for the runtime layer by name (as the bootstrap asks for it), CDS and LDS by
  wildcard;
- after each CDS response, EDS for the ClusterLoadAssignments its clusters reference, and
  after each LDS response, RDS for the route configurations its listeners reference (by the
  server's own rule, `references_of`), asked before the CDS or LDS response is ACKed, as
  Envoy does;
- every response ACKed: SotW repeats the type's subscription with the response's version
  and nonce, Delta sends the nonce;
- what a client holds: a SotW CDS, LDS or RTDS response is complete (what it leaves out is
  gone), a SotW EDS or RDS response may carry only what changed (the rest is kept), a
  Delta response names what it removes.

Unlike Envoy, a client whose stream ends does not reconnect: it is reported disconnected,
which in a benchmark is a finding, not something to paper over.

Each response is recorded (`ResponseRecord`): when it was received and when its ACK was
written (`time.monotonic()`, one clock for every process on Linux, so the parent compares
these with its own times), its type, version, exact size on the wire (responses are taken
as raw bytes and parsed here), and the names of the resources carried and removed. Names
are read without decoding the resources where possible: every xDS resource's name is its
field 1 (`first_string`), which costs a microsecond where decoding a ClusterLoadAssignment
of a hundred endpoints costs far more, and the clients share the machine with the server
they measure. Clusters and listeners are decoded (their references are needed), once per
distinct serialized form per process.

The parent drives each child over stdin and stdout, one JSON line per command and per reply
(`ClientGroup`): `start` opens every stream at once (a connect storm), `served` waits until
every client has its full first config, `acks` until every served client has ACKed a new
version of a type, `report` hands over the records since the last report, and `quit`
closes the streams. Nothing crosses the pipe while the clients wait: a reply is written
once its wait is over, and records only when asked for, between measurements.

    python -m bench.fleet_clients --target 127.0.0.1:18000 --first 0 --count 100 \
        [--delta] [--node-cluster fleet]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from xds_server.envoy.names import RUNTIME_LAYER_NAME
from xds_server.xds.resources import ResourceType, references_of

__all__ = [
    "AckSeen",
    "ClientGroup",
    "ResponseRecord",
    "ServedReply",
    "first_string",
    "main",
    "node_id_of",
]

_SERVICE = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
_METHODS = {
    False: _SERVICE + "StreamAggregatedResources",
    True: _SERVICE + "DeltaAggregatedResources",
}
_CHANNEL_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),  # one connection per client, as per Envoy
    ("grpc.max_receive_message_length", -1),  # a big fleet's CDS passes gRPC's 4 MB
)
# The most often a waiting command looks at the clients again (the times it reports are
# recorded per response, so this bounds only how late the reply comes).
_POLL_S = 0.05
_REPO = Path(__file__).resolve().parents[1]
_DEPENDENT = {
    ResourceType.CLUSTER: ResourceType.ENDPOINT,
    ResourceType.LISTENER: ResourceType.ROUTE,
}
_BY_SHORT = {t.short: t for t in ResourceType}


def node_id_of(index: int) -> str:
    """The node id of client `index`."""
    return f"fleet-client-{index}"


# -- records ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ResponseRecord:
    """One response a client received: monotonic receive and ACK times, type (cds, eds,
    ...), version, size in bytes, and the names of the resources it carried and removed."""

    client: int
    type: str
    version: str
    received: float
    acked: float
    bytes: int
    names: tuple[str, ...]
    removed: tuple[str, ...]

    def to_wire(self) -> list[Any]:
        return [
            self.client, self.type, self.version, self.received, self.acked, self.bytes,
            list(self.names), list(self.removed),
        ]  # fmt: skip

    @classmethod
    def from_wire(cls, row: Sequence[Any]) -> ResponseRecord:
        client, type_, version, received, acked, size, names, removed = row
        return cls(
            client=int(client), type=str(type_), version=str(version),
            received=float(received), acked=float(acked), bytes=int(size),
            names=tuple(names), removed=tuple(removed),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class AckSeen:
    """A client's first ACK of a new version (`ClientGroup.await_acks`)."""

    received: float
    acked: float
    version: str
    bytes: int
    resources: int


@dataclass(frozen=True, kw_only=True)
class ServedReply:
    """When each client had its full first config (None: not by the deadline), and why
    the clients whose stream ended lost it."""

    served_at: Mapping[int, float | None]
    errors: Mapping[int, str]


# -- wire helpers ------------------------------------------------------------------------


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def first_string(data: bytes) -> str:
    """Field 1 of a serialized message, as a string ("" when absent): the name of every xDS
    resource (a ClusterLoadAssignment's is its `cluster_name`). Other fields are skipped
    unread. Raises ValueError on a wire type it cannot skip."""
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        wire_type = key & 7
        if wire_type == 2:
            length, at = _varint(data, at)
            if key >> 3 == 1:
                return data[at : at + length].decode()
            at += length
        elif wire_type == 0:
            _, at = _varint(data, at)
        elif wire_type == 1:
            at += 8
        elif wire_type == 5:
            at += 4
        else:
            raise ValueError(f"wire type {wire_type} in a resource")
    return ""


class _Decoded:
    """Names and references of clusters and listeners, by their serialized form: the
    clients of one process receive the same bytes, so each is decoded once."""

    def __init__(self) -> None:
        self._cache: dict[tuple[ResourceType, bytes], tuple[str, frozenset[str]]] = {}

    def __call__(self, resource_type: ResourceType, value: bytes) -> tuple[str, frozenset[str]]:
        key = (resource_type, value)
        found = self._cache.get(key)
        if found is None:
            message = resource_type.message_class.FromString(value)
            found = (first_string(value), references_of(resource_type, message))
            self._cache[key] = found
        return found


# -- clients -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ack:
    received: float
    acked: float
    version: str
    bytes: int
    resources: int


@dataclass
class _Client:
    """One Envoy-like ADS client (module docstring). Mutable state: everything below,
    changed only by its own task; the command loop reads it."""

    index: int
    target: str
    node_cluster: str
    delta: bool
    decoded: _Decoded
    records: list[ResponseRecord]
    # Set whenever something changes that a waiting command may be waiting for.
    changed: asyncio.Event
    connected: bool = False
    served_at: float | None = None
    error: str | None = None
    acks: dict[ResourceType, list[_Ack]] = field(default_factory=dict)
    # Per dependent type (EDS, RDS): what the parents reference and what is subscribed;
    # per type: the names the client holds.
    needed: dict[ResourceType, frozenset[str]] = field(default_factory=dict)
    subscribed: dict[ResourceType, frozenset[str]] = field(default_factory=dict)
    held: dict[ResourceType, set[str]] = field(default_factory=dict)
    # SotW: the last version and nonce per type. Delta: each parent's references by name.
    versions: dict[ResourceType, tuple[str, str]] = field(default_factory=dict)
    parents: dict[ResourceType, dict[str, frozenset[str]]] = field(default_factory=dict)

    async def run(self) -> None:
        """Hold the stream until it ends or the task is cancelled."""
        channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        opened = time.monotonic()
        try:
            call = channel.stream_stream(
                _METHODS[self.delta],
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=lambda payload: payload,
            )()
            self.connected = True
            await self._converse(call)
            self.error = "the server ended the stream"
        except grpc.aio.AioRpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
        finally:
            if self.error is not None:
                self.error += f" (after {time.monotonic() - opened:.1f} s)"
            self.connected = False
            self.changed.set()
            await channel.close(grace=None)

    async def _converse(self, call: Any) -> None:
        node = base_pb2.Node(id=node_id_of(self.index), cluster=self.node_cluster)
        await call.write(self._subscribe(ResourceType.RUNTIME, [RUNTIME_LAYER_NAME], node=node))
        await call.write(self._subscribe(ResourceType.CLUSTER, []))
        await call.write(self._subscribe(ResourceType.LISTENER, []))
        while (payload := await call.read()) is not grpc.aio.EOF:
            received = time.monotonic()
            if self.delta:
                await self._on_delta(call, payload, received)
            else:
                await self._on_sotw(call, payload, received)

    def _subscribe(self, resource_type: ResourceType, names: list[str], node: Any = None) -> Any:
        if self.delta:
            return discovery_pb2.DeltaDiscoveryRequest(
                node=node, type_url=resource_type.url, resource_names_subscribe=names
            )
        return discovery_pb2.DiscoveryRequest(
            node=node, type_url=resource_type.url, resource_names=names
        )

    # SotW: every response is the whole state of its type.
    async def _on_sotw(self, call: Any, payload: bytes, received: float) -> None:
        response = discovery_pb2.DiscoveryResponse.FromString(payload)
        resource_type = _type_of(response.type_url)
        values = [resource.value for resource in response.resources]
        if resource_type in _DEPENDENT:
            decoded = [self.decoded(resource_type, value) for value in values]
            names = [name for name, _ in decoded]
            await self._follow(call, resource_type, frozenset().union(*(r for _, r in decoded)))
        else:
            names = [first_string(value) for value in values]
        if resource_type in _DEPENDENT.values():
            # EDS and RDS responses may carry only what changed: what they leave out is kept.
            held = self.held.setdefault(resource_type, set())
            held.update(names)
            held.intersection_update(self.subscribed.get(resource_type, ()))
        else:
            self.held[resource_type] = set(names)
        self.versions[resource_type] = (response.version_info, response.nonce)
        await call.write(self._sotw_request(resource_type))
        self._record(resource_type, response.version_info, received, len(payload), names, [])

    def _sotw_request(self, resource_type: ResourceType) -> Any:
        version, nonce = self.versions.get(resource_type, ("", ""))
        if resource_type is ResourceType.RUNTIME:
            names = [RUNTIME_LAYER_NAME]
        else:
            names = sorted(self.subscribed.get(resource_type, ()))  # wildcard: none
        return discovery_pb2.DiscoveryRequest(
            type_url=resource_type.url,
            resource_names=names,
            version_info=version,
            response_nonce=nonce,
        )

    # Delta: a response carries what changed.
    async def _on_delta(self, call: Any, payload: bytes, received: float) -> None:
        response = discovery_pb2.DeltaDiscoveryResponse.FromString(payload)
        resource_type = _type_of(response.type_url)
        names = [resource.name for resource in response.resources]
        removed = list(response.removed_resources)
        if resource_type in _DEPENDENT:
            parents = self.parents.setdefault(resource_type, {})
            for resource in response.resources:
                parents[resource.name] = self.decoded(resource_type, resource.resource.value)[1]
            for name in removed:
                parents.pop(name, None)
            await self._follow(call, resource_type, frozenset().union(*parents.values()))
        held = self.held.setdefault(resource_type, set())
        held.update(names)
        held.difference_update(removed)
        await call.write(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=response.type_url, response_nonce=response.nonce
            )
        )
        self._record(
            resource_type, response.system_version_info, received, len(payload), names, removed
        )

    async def _follow(self, call: Any, parent: ResourceType, references: frozenset[str]) -> None:
        """Subscribe the dependent type to exactly `references`, if that is a change."""
        dependent = _DEPENDENT[parent]
        self.needed[dependent] = references
        old = self.subscribed.get(dependent, frozenset())
        if references == old:
            return
        self.subscribed[dependent] = references
        if self.delta:
            gone = sorted(old - references)
            self.held.setdefault(dependent, set()).difference_update(gone)
            await call.write(
                discovery_pb2.DeltaDiscoveryRequest(
                    type_url=dependent.url,
                    resource_names_subscribe=sorted(references - old),
                    resource_names_unsubscribe=gone,
                )
            )
        else:
            await call.write(self._sotw_request(dependent))

    def _record(
        self,
        resource_type: ResourceType,
        version: str,
        received: float,
        size: int,
        names: list[str],
        removed: list[str],
    ) -> None:
        acked = time.monotonic()
        self.acks.setdefault(resource_type, []).append(
            _Ack(received, acked, version, size, len(names))
        )
        self.records.append(
            ResponseRecord(
                client=self.index, type=resource_type.short, version=version, received=received,
                acked=acked, bytes=size, names=tuple(names), removed=tuple(removed),
            )
        )  # fmt: skip
        if self.served_at is None and self._has_full_config():
            self.served_at = acked
        self.changed.set()

    def _has_full_config(self) -> bool:
        if any(t not in self.acks for t in ResourceType):
            return False
        return all(
            self.needed.get(t, frozenset()) <= self.held.get(t, set()) for t in _DEPENDENT.values()
        )

    def first_new_ack(self, resource_type: ResourceType, after: float) -> _Ack | None:
        """The first ACK of a response received at or after `after` whose version differs
        from the one held before then."""
        held: str | None = None
        for ack in self.acks.get(resource_type, ()):
            if ack.received < after:
                held = ack.version
            elif ack.version != held:
                return ack
        return None


def _type_of(type_url: str) -> ResourceType:
    resource_type = ResourceType.from_url(type_url)
    if resource_type is None:
        raise ValueError(f"a response of unknown type {type_url}")
    return resource_type


# -- the child's command loop ------------------------------------------------------------


class _Child:
    """The clients of one process and the commands that drive them (module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        decoded = _Decoded()
        self.records: list[ResponseRecord] = []
        self.changed = asyncio.Event()
        self.clients = [
            _Client(
                index=index,
                target=args.target,
                node_cluster=args.node_cluster,
                delta=args.delta,
                decoded=decoded,
                records=self.records,
                changed=self.changed,
            )
            for index in range(args.first, args.first + args.count)
        ]
        self.tasks: list[asyncio.Task[None]] = []
        self._commands: dict[str, Callable[[dict[str, Any]], Any]] = {
            "start": self._start,
            "served": self._served,
            "acks": self._acks,
            "report": self._report,
            "quit": self._quit,
        }

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._commands[command["cmd"]](command)
        return result

    async def _start(self, command: dict[str, Any]) -> dict[str, Any]:
        self.tasks = [asyncio.create_task(client.run()) for client in self.clients]
        return {"started": time.monotonic()}

    async def _wait_until(self, done: Callable[[], bool], deadline: float) -> None:
        """Return once `done()` is true or at `deadline` (monotonic). `done` is tried again
        when a client records something, at most every _POLL_S: a push brings a hundred
        ACKs in a burst, and checking after each would cost the server's CPU."""
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)
            await asyncio.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    async def _served(self, command: dict[str, Any]) -> dict[str, Any]:
        await self._wait_until(
            lambda: all(c.served_at is not None or c.error is not None for c in self.clients),
            float(command["deadline"]),
        )
        return {
            "served": {str(c.index): c.served_at for c in self.clients},
            "errors": {str(c.index): c.error for c in self.clients if c.error is not None},
        }

    async def _acks(self, command: dict[str, Any]) -> dict[str, Any]:
        resource_type = _BY_SHORT[command["type"]]
        after, deadline = float(command["after"]), float(command["deadline"])

        def pending() -> list[_Client]:
            return [
                c
                for c in self.clients
                if c.connected and c.served_at is not None
                and c.first_new_ack(resource_type, after) is None
            ]  # fmt: skip

        await self._wait_until(lambda: not pending(), deadline)
        acks: dict[str, list[Any] | None] = {}
        for client in self.clients:
            if client.served_at is None:
                continue
            ack = client.first_new_ack(resource_type, after)
            if ack is not None:
                acks[str(client.index)] = [
                    ack.received,
                    ack.acked,
                    ack.version,
                    ack.bytes,
                    ack.resources,
                ]
            elif client.connected:
                acks[str(client.index)] = None
        return {"acks": acks}

    async def _report(self, command: dict[str, Any]) -> dict[str, Any]:
        rows = [record.to_wire() for record in self.records]
        self.records.clear()
        return {"records": rows}

    async def _quit(self, command: dict[str, Any]) -> dict[str, Any]:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        return {"quit": True}


async def _child(args: argparse.Namespace, out: TextIO) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    child = _Child(args)

    def reply(message: dict[str, Any]) -> None:
        out.write(json.dumps(message, separators=(",", ":")) + "\n")
        out.flush()

    reply({"ready": True})
    try:
        while line := await reader.readline():
            command = json.loads(line)
            reply(await child.handle(command))
            if command["cmd"] == "quit":
                return
    finally:
        await child.handle({"cmd": "quit"})  # stdin closed: the parent is gone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--target", required=True, help="the server's xDS address, host:port")
    parser.add_argument("--first", type=int, default=0, help="index of the first client")
    parser.add_argument("--count", type=int, required=True, help="clients in this process")
    parser.add_argument("--delta", action="store_true", help="Delta xDS (default SotW)")
    parser.add_argument("--node-cluster", default="fleet", help="node.cluster of every client")
    args = parser.parse_args(argv)
    # Replies go to the original stdout alone; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_child(args, out))
    return 0


# -- the parent's side -------------------------------------------------------------------


class ClientGroup:
    """`clients` ADS clients against `target`, `per_process` to a child process.

    Use `async with`: entering starts the processes and waits until each has imported its
    libraries (so that `start` is a real storm: every stream opened within milliseconds);
    leaving asks each to quit and kills, by its PID, any still running after `stop_s`.
    Mutable state: `_processes` and one lock each (one command at a time per child).
    """

    def __init__(
        self,
        *,
        target: str,
        clients: int,
        delta: bool,
        node_cluster: str,
        per_process: int = 100,
        ready_within_s: float = 60.0,
        stop_s: float = 10.0,
    ) -> None:
        self._target = target
        self._clients = clients
        self._delta = delta
        self._node_cluster = node_cluster
        self._per_process = per_process
        self._ready_within_s = ready_within_s
        self._stop_s = stop_s
        self._processes: list[asyncio.subprocess.Process] = []
        self._locks: list[asyncio.Lock] = []

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(process.pid for process in self._processes)

    async def __aenter__(self) -> ClientGroup:
        path = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
        try:
            for first in range(0, self._clients, self._per_process):
                count = min(self._per_process, self._clients - first)
                args = [
                    "-m", "bench.fleet_clients", "--target", self._target,
                    "--first", str(first), "--count", str(count),
                    "--node-cluster", self._node_cluster, *(["--delta"] if self._delta else []),
                ]  # fmt: skip
                self._processes.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        *args,
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        limit=1 << 30,
                        env={**os.environ, "PYTHONPATH": path},
                    )
                )
                self._locks.append(asyncio.Lock())
            await asyncio.wait_for(
                asyncio.gather(*(self._read(i) for i in range(len(self._processes)))),
                self._ready_within_s,
            )
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

    async def _stop(self) -> None:
        async def stop(i: int, process: asyncio.subprocess.Process) -> None:
            if process.returncode is None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._ask(i, {"cmd": "quit"}), self._stop_s)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(process.wait(), self._stop_s)
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()

        try:
            await asyncio.gather(*(stop(i, p) for i, p in enumerate(self._processes)))
        finally:
            for process in self._processes:  # even when cancelled: no process left behind
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()

    async def _read(self, i: int) -> dict[str, Any]:
        stream = self._processes[i].stdout
        assert stream is not None
        line = await stream.readline()
        if not line:
            raise RuntimeError(
                f"Client process {self._processes[i].pid} exited (status "
                f"{self._processes[i].returncode}); its stderr says why."
            )
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def _ask(self, i: int, command: dict[str, Any]) -> dict[str, Any]:
        process = self._processes[i]
        assert process.stdin is not None
        async with self._locks[i]:
            process.stdin.write(json.dumps(command).encode() + b"\n")
            await process.stdin.drain()
            return await self._read(i)

    async def _ask_all(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        return list(
            await asyncio.gather(*(self._ask(i, command) for i in range(len(self._processes))))
        )

    async def start(self) -> float:
        """Open every client's stream at once; returns the monotonic time it began."""
        began = time.monotonic()
        await self._ask_all({"cmd": "start"})
        return began

    async def await_served(self, *, deadline: float) -> ServedReply:
        """Wait until every client has its full first config (or its stream ended), or
        until `deadline` (monotonic)."""
        served: dict[int, float | None] = {}
        errors: dict[int, str] = {}
        for reply in await self._ask_all({"cmd": "served", "deadline": deadline}):
            served.update({int(k): v for k, v in reply["served"].items()})
            errors.update({int(k): v for k, v in reply["errors"].items()})
        return ServedReply(served_at=served, errors=errors)

    async def await_acks(
        self, type_name: str, *, after: float, deadline: float
    ) -> dict[int, AckSeen | None]:
        """For each client that has its first config and is connected: its first ACK of a
        `type_name` response received at or after `after` with a version other than the
        one it held then (None: none by `deadline`). Waits until every such client has
        one, or until `deadline`."""
        command = {"cmd": "acks", "type": type_name, "after": after, "deadline": deadline}
        seen: dict[int, AckSeen | None] = {}
        for reply in await self._ask_all(command):
            for key, row in reply["acks"].items():
                seen[int(key)] = None if row is None else AckSeen(
                    received=row[0], acked=row[1], version=row[2], bytes=row[3],
                    resources=row[4],
                )  # fmt: skip
        return seen

    async def report(self) -> list[ResponseRecord]:
        """Every response received since the last report, by every client."""
        records: list[ResponseRecord] = []
        for reply in await self._ask_all({"cmd": "report"}):
            records.extend(ResponseRecord.from_wire(row) for row in reply["records"])
        return records


if __name__ == "__main__":
    sys.exit(main())
