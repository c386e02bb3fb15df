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

# Bytes aiohttp adds around a chunk (its chunked-encoding size line and end).
_FRAMING = 32


class ClientStalled(Exception):
    """The client made no progress reading the answer within the send bounds."""


@dataclass(frozen=True)
class ClientSender:
    request: web.Request
    deadline: float  # loop time: the request's own end
    idle_s: float  # the longest one write may wait for the client to read

    async def prepare(self, out: web.StreamResponse) -> None:
        await self._bounded(out.prepare(self.request), self.deadline)

    async def write(self, out: web.StreamResponse, data: bytes) -> None:
        transport = self.request.transport
        if transport is not None and not transport.is_closing():
            # Room in the socket's buffer for all of it: the write cannot wait for the client,
            # so no timer is needed (most writes of a stream; a timer each cost µs).
            high = transport.get_write_buffer_limits()[1]
            if transport.get_write_buffer_size() + len(data) + _FRAMING < high:
                await out.write(data)
                return
        await self._bounded(out.write(data), self.deadline)

    async def finish(self, out: web.StreamResponse, last: bytes = b"") -> None:
        """The last bytes and the end: after the deadline too (an error event says why the
        stream ends), so bounded by the idle timeout alone."""
        if last:
            await self._bounded(out.write(last), None)
        await self._bounded(out.write_eof(), None)

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
