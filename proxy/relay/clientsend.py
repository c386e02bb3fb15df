"""Writes to the client, each bounded: a client that stops reading must not hold a backend slot.

Every write (the headers, each chunk, the end) gets the request's deadline and a send-idle
timeout, whichever comes first; a write that cannot finish by then aborts the client's
connection (its unsent bytes would never leave) and raises ``ClientStalled``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

# Bytes aiohttp adds around a chunk (its chunked-encoding size line and end), and a bound on
# a response's headers.
_FRAMING = 32
_HEADERS = 4096


class ClientStalled(Exception):
    """The client made no progress reading the answer within the send bounds."""


@dataclass(frozen=True)
class ClientSender:
    request: web.Request
    deadline: float  # loop time: the request's own end
    idle_s: float  # the longest one write may wait for the client to read

    async def prepare(self, out: web.StreamResponse) -> None:
        if self._has_room(_HEADERS):
            await out.prepare(self.request)
        else:
            await self._bounded(out.prepare(self.request), self.deadline)

    async def write(self, out: web.StreamResponse, data: bytes) -> None:
        if self._has_room(len(data)):
            await out.write(data)
        else:
            await self._bounded(out.write(data), self.deadline)

    async def finish(self, out: web.StreamResponse, last: bytes = b"") -> None:
        """The last bytes and the end: after the deadline too (an error event says why the
        stream ends), so bounded by the idle timeout alone."""
        if self._has_room(len(last)):
            if last:
                await out.write(last)
            await out.write_eof()
            return
        if last:
            await self._bounded(out.write(last), None)
        await self._bounded(out.write_eof(), None)

    def _has_room(self, size: int) -> bool:
        """Whether ``size`` more bytes fit the socket's buffer below its high-water mark: then
        the write cannot wait for the client (aiohttp drains only a paused transport), so it
        needs no timer (most writes of a stream; a timer each costs µs)."""
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return False
        high = transport.get_write_buffer_limits()[1]
        return transport.get_write_buffer_size() + size + _FRAMING < high

    async def _bounded(self, write: Awaitable[Any], deadline: float | None) -> None:
        limit = asyncio.get_running_loop().time() + self.idle_s
        try:
            async with asyncio.timeout_at(limit if deadline is None else min(deadline, limit)):
                await write
        except TimeoutError:
            self.abort()
            raise ClientStalled from None

    def abort(self) -> None:
        """Drop the client's connection at once (a close would wait to flush to a non-reader)."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()
