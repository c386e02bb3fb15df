"""Writes to the client, each bounded: a client that stops reading must not hold a backend slot.

Every write (the headers, each chunk, the end) gets the request's deadline and a send-idle
timeout, whichever comes first; a write that cannot finish by then aborts the client's
connection (its unsent bytes would never leave) and raises ``ClientStalled``.

A client that lags gets a read-ahead: its connection's write buffer may hold up to
``read_ahead`` bytes unsent (its high-water mark raised from asyncio's 64 KiB), so that the
upstream is read on, and once it ends the backend's room is handed on while the rest drains
(``settle``). Its bytes are reserved from the memory budget, within half of it; beyond that a
stream lags as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.relay.budget import MemoryBudget, Reservation

# Bytes aiohttp adds around a chunk (its chunked-encoding size line and end), and a bound on
# a response's headers.
_FRAMING = 32
_HEADERS = 4096


class ClientStalled(Exception):
    """The client made no progress reading the answer within the send bounds."""


@dataclass
class ClientSender:
    request: web.Request
    deadline: float  # loop time: the request's own end
    idle_s: float  # the longest one write may wait for the client to read
    read_ahead: int = 0  # bytes a lagging client's connection may hold unsent; 0: none
    budget: MemoryBudget | None = None  # where the read-ahead's bytes are reserved
    # The connection's own (low, high) write-buffer limits while the read-ahead is on.
    _own: tuple[int, int] | None = field(default=None, init=False)
    _held: Reservation | None = field(default=None, init=False)

    async def prepare(self, out: web.StreamResponse) -> None:
        if self._has_room(_HEADERS):
            await out.prepare(self.request)
        else:
            await self._bounded(out.prepare(self.request), self.deadline)

    async def write(self, out: web.StreamResponse, data: bytes) -> None:
        if self._has_room(len(data)) or self._widen(len(data)):
            await out.write(data)
        else:
            await self._bounded(out.write(data), self.deadline)

    async def finish(self, out: web.StreamResponse, last: bytes = b"") -> None:
        """The last bytes and the end: after the deadline too (an error event says why the
        stream ends), so bounded by the idle timeout alone."""
        await self.settle()
        if self._has_room(len(last)):
            if last:
                await out.write(last)
            await out.write_eof()
            return
        if last:
            await self._bounded(out.write(last), None)
        await self._bounded(out.write_eof(), None)

    async def settle(self) -> None:
        """The read-ahead off (the upstream has ended): wait while the client reads what it
        holds down to the connection's own mark, each step of the connection's own hysteresis
        (what a paused write waits for) bounded by the idle timeout alone, as ``finish`` is: the
        answer is whole, or ends with the error event saying why (a stream cut at its deadline
        had that event aborted unsent: red team of stop 55). Raises ``ClientStalled``."""
        transport = self.request.transport
        try:
            if self._own is None or transport is None:
                return
            low, high = self._own
            step = max(high - low, 1)
            while not transport.is_closing():
                if (pending := transport.get_write_buffer_size()) <= high:
                    break
                # Paused at once (asyncio's and uvloop's transports both check on a change);
                # resumed once the client has read ``step`` more bytes.
                transport.set_write_buffer_limits(high=pending - 1, low=max(pending - step, 0))
                try:
                    await self._bounded(self.request.writer.drain(), None)
                except ConnectionError as exc:  # aiohttp's drain waiter after a reset
                    raise ConnectionResetError(str(exc)) from exc
        finally:
            self.close()

    def close(self) -> None:
        """The read-ahead's reservation given back (the relay's end, whatever it was); a
        connection still widened goes back to its own limits."""
        own, self._own = self._own, None
        transport = self.request.transport
        if own is not None and transport is not None and not transport.is_closing():
            transport.set_write_buffer_limits(high=own[1], low=own[0])
        held, self._held = self._held, None
        if held is not None:
            held.release()

    def _widen(self, size: int) -> bool:
        """The client lags (this write would wait): raise the connection's high-water mark to
        the read-ahead, once per answer, with the same hysteresis as its own. True when the
        write then fits; False, changing nothing, where there is no read-ahead to give (none
        set, the budget's half taken, the connection closing)."""
        transport = self.request.transport
        if self._own is not None or transport is None or transport.is_closing():
            return False
        low, high = transport.get_write_buffer_limits()
        if self.read_ahead <= high:
            return False
        if self.budget is not None:
            self._held = self.budget.try_reserve_spare(self.read_ahead)
            if self._held is None:
                return False
        self._own = (low, high)
        transport.set_write_buffer_limits(high=self.read_ahead, low=self.read_ahead - high + low)
        return self._has_room(size)

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
