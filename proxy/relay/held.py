"""A buffered answer whose bytes are reserved from the memory budget until they are sent.

The pipeline writes it itself (``HeldResponse.send``), a slice at a time, each write bounded by
the send-idle timeout like a stream's (``proxy.relay.clientsend``): a client that stops reading
a buffered answer is cut, logged 499 ``client_stalled``, and its bytes leave the budget then.
aiohttp's own write after the handler returns finds the answer already sent. The finalizer gives
the reservation back where the answer is dropped unsent (the client left before).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

from aiohttp import web

from proxy.relay.budget import Reservation
from proxy.relay.clientsend import ClientSender

# One write's size: a slow client that keeps reading makes progress within each write's bound;
# one write of the whole answer would have to drain in a single idle timeout.
SLICE_BYTES = 64 * 1024


class HeldResponse(web.Response):
    def __init__(
        self, status: int, body: bytes, headers: Mapping[str, str], held: Reservation
    ) -> None:
        super().__init__(status=status, body=body, headers=headers)
        self.held = held
        self._sent_in_slices = False
        weakref.finalize(self, held.release)

    async def send(self, request: web.Request, idle_s: float) -> None:
        """Write the whole answer now, each slice within ``idle_s``; raises ``ClientStalled``
        (the connection is aborted) or a connection error. The reservation is released either
        way: the bytes are on their way out or will never be."""
        sender = ClientSender(request, math.inf, idle_s)
        try:
            await sender.prepare(self)
            # Read after prepare: its hooks may have replaced the body (proxy.server.json_errors
            # rewrites a backend's non-JSON error), and the Content-Length sent is the new one.
            body = self.body
            writer = self._payload_writer
            if isinstance(body, bytes | bytearray) and writer is not None:
                # aiohttp fixed the writer's length before the hooks ran; the headers sent carry
                # the body's length now (a hook that replaces the body sets it).
                if writer.length is not None:
                    writer.length = len(body)
                self._sent_in_slices = True
                for start in range(0, len(body), SLICE_BYTES):
                    await sender.write(self, bytes(body[start : start + SLICE_BYTES]))
            await sender.finish(self)  # a body of another kind: written whole by write_eof
        finally:
            self.held.release()

    async def write_eof(self, data: bytes = b"") -> None:
        try:
            if self._sent_in_slices:  # the body went out in slices: only the end is left
                await web.StreamResponse.write_eof(self, data)
            else:
                await super().write_eof(data)
        finally:
            self.held.release()


def held_response(
    status: int, body: bytes, headers: Mapping[str, str], held: Reservation | None
) -> web.Response:
    if held is None:
        return web.Response(status=status, body=body, headers=headers)
    return HeldResponse(status, body, headers, held)
