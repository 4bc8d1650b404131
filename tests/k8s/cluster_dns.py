"""A stand-in for cluster DNS: a UDP name server on loopback that answers A queries for
the names it is given (each with 127.0.0.1) and NXDOMAIN for every other, as CoreDNS does
for a Service's full name and for the names a pod's search path makes up on the way."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import cast

__all__ = ["ClusterDns", "cluster_dns"]

_A, _IN = 1, 1
_NXDOMAIN = 3


def _question(packet: bytes) -> tuple[str, int, int]:
    """The query's name, type, and the offset just past its question."""
    labels, offset = [], 12
    while (length := packet[offset]) != 0:
        labels.append(packet[offset + 1 : offset + 1 + length].decode("ascii").lower())
        offset += 1 + length
    qtype, _ = struct.unpack("!HH", packet[offset + 1 : offset + 5])
    return ".".join(labels), qtype, offset + 5


class ClusterDns(asyncio.DatagramProtocol):
    """Answers for `names`; `asked` keeps every name queried, in order."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = {name.lower().rstrip(".") for name in names}
        self.asked: list[str] = []
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's datagram transports do not derive from DatagramTransport.
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self._transport is not None
        (query_id,) = struct.unpack("!H", data[:2])
        name, qtype, end = _question(data)
        self.asked.append(name)
        known = name in self._names
        answers = 1 if known and qtype == _A else 0
        flags = 0x8400 | (0 if known else _NXDOMAIN)  # response, authoritative
        header = struct.pack("!HHHHHH", query_id, flags, 1, answers, 0, 0)
        answer = b""
        if answers:
            # A pointer to the question's name, A, IN, a 5 s TTL, 127.0.0.1.
            address = socket.inet_aton("127.0.0.1")
            answer = struct.pack("!HHHIH", 0xC00C, _A, _IN, 5, len(address)) + address
        self._transport.sendto(header + data[12:end] + answer, addr)


@asynccontextmanager
async def cluster_dns(names: Iterable[str]) -> AsyncIterator[tuple[ClusterDns, int]]:
    """The server on 127.0.0.1 and a free UDP port; yields it and the port."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: ClusterDns(names), local_addr=("127.0.0.1", 0)
    )
    try:
        yield protocol, transport.get_extra_info("sockname")[1]
    finally:
        transport.close()
