"""Model servers that fail on purpose, for tests of what Envoy and the server do then.

`FaultyServer` is a raw TCP server on 127.0.0.1 that reads each HTTP request's head and
then fails it the way a dying pod does:

- `RESET`: the connection is reset (RST) before any response byte: a crash mid-prefill;
- `HANG`: nothing is ever answered: a stuck engine;
- `REFUSE`: nothing listens on the port any more: a killed pod (connections are refused).

Mutable state: `requests` (request heads read) and the asyncio server.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import struct
from types import TracebackType

__all__ = ["Fault", "FaultyServer"]


class Fault(enum.Enum):
    RESET = "reset"
    HANG = "hang"
    REFUSE = "refuse"


class FaultyServer:
    """A pod that fails every request with `fault`, as an async context manager."""

    def __init__(self, fault: Fault, *, host: str = "127.0.0.1") -> None:
        self.fault = fault
        self.host = host
        self.port = 0
        self.requests = 0
        self._server: asyncio.Server | None = None
        self._hung: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> FaultyServer:
        if self.fault is Fault.REFUSE:
            # A port that was free a moment ago and that nothing listens on: refused.
            with socket.socket() as probe:
                probe.bind((self.host, 0))
                self.port = probe.getsockname()[1]
            return self
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for writer in self._hung:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                self.requests += 1
                if self.fault is Fault.HANG:
                    self._hung.add(writer)
                    continue
                # SO_LINGER 0: close() sends RST instead of FIN, as a crashed process does.
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
