"""A buffered answer whose bytes are reserved from the memory budget until they are sent.

The handler returns the response and aiohttp writes it afterwards, so the reservation is given
back at the end of ``write_eof`` — or, where the client left before, when the response is
dropped (a finalizer: refcounting frees it as soon as aiohttp lets go of it).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

from aiohttp import web

from proxy.relay.budget import Reservation


class HeldResponse(web.Response):
    def __init__(
        self, status: int, body: bytes, headers: Mapping[str, str], held: Reservation
    ) -> None:
        super().__init__(status=status, body=body, headers=headers)
        self.held = held
        weakref.finalize(self, held.release)

    async def write_eof(self, data: bytes = b"") -> None:
        try:
            await super().write_eof(data)
        finally:
            self.held.release()


def held_response(
    status: int, body: bytes, headers: Mapping[str, str], held: Reservation | None
) -> web.Response:
    if held is None:
        return web.Response(status=status, body=body, headers=headers)
    return HeldResponse(status, body, headers, held)
