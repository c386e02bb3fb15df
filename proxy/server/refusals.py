"""What a listener answers before aiohttp parses anything: canned JSON (over the connection cap,
headers late, too large or over the header memory budget), the refused connection's protocol,
a rate-limited log line for refusals, and the budget of unfinished header bytes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol, cast

log = logging.getLogger("tierproxy")


def canned(status: str, code: str, message: str, extra: str = "") -> bytes:
    body = (
        f'{{"error": {{"message": "{message}", "type": "{code}", "param": null,'
        f' "code": "{code}"}}}}'
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


OVER_CAPACITY = canned(
    "503 Service Unavailable",
    "too_many_connections",
    "The proxy holds its maximum of open connections; retry shortly.",
    "Retry-After: 1\r\n",
)
HEADER_TIMEOUT = canned(
    "408 Request Timeout", "header_timeout", "The request headers did not arrive in time."
)


def headers_too_large(limit: int) -> bytes:
    return canned(
        "431 Request Header Fields Too Large",
        "request_header_fields_too_large",
        f"The request line and headers are over {limit} bytes (server.max_header_bytes).",
    )


HEADER_MEMORY_FULL = canned(
    "503 Service Unavailable",
    "header_memory_full",
    "The proxy holds its maximum of unfinished request headers; retry shortly.",
    "Retry-After: 1\r\n",
)

# A refused connection stays open this long at most, reading and dropping what the client sends:
# closing a socket with unread bytes sends a RST, and a RST can reach the client before the 503
# it would then never read.
REFUSAL_LINGER_S = 1.0
MAX_LINGERING = 256  # past this many lingering refusals, close at once (fds stay bounded)


class Refusal(asyncio.Protocol):
    """One canned answer, then close: costs no parsing and no handler task."""

    def __init__(self, answer: bytes, lingering: list[int] | None = None) -> None:
        self.answer = answer
        self.lingering = lingering  # a shared one-item counter; None: close at once
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport instances; they write all the same.
        writer = cast(asyncio.WriteTransport, transport)
        writer.write(self.answer)
        if self.lingering is None or self.lingering[0] >= MAX_LINGERING:
            self.lingering = None
            writer.close()
            return
        self.lingering[0] += 1
        if writer.can_write_eof():
            writer.write_eof()  # the answer, then FIN; what the client sends is dropped
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, writer.close)

    def data_received(self, data: bytes) -> None:
        pass  # the client's request, never parsed

    def eof_received(self) -> bool:
        return False  # the client is done too: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.lingering is not None:
            self.lingering[0] -= 1
            self.lingering = None


class RefusalLog:
    """At most one log line per ``every_s`` for a kind of refusal: the first at once, later ones
    with the count since the last line (a flood of refusals must not flood the log)."""

    def __init__(
        self,
        what: str,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        verb: str = "refused",
    ) -> None:
        self.what = what
        self.verb = verb
        self.every_s = every_s
        self.clock = clock
        self.total = 0
        self.unlogged = 0
        self.logged_at: float | None = None

    def refused(self) -> None:
        self.total += 1
        self.unlogged += 1
        now = self.clock()
        if self.logged_at is not None and now - self.logged_at < self.every_s:
            return
        since = "" if self.logged_at is None else f" in the last {now - self.logged_at:.0f} s"
        log.warning(
            "%s: %d connection(s) %s%s, %d since start",
            self.what,
            self.unlogged,
            self.verb,
            since,
            self.total,
        )
        self.logged_at = now
        self.unlogged = 0


class HeaderBudget:
    """Bytes of request headers received but not yet complete, on all connections together.

    aiohttp's parser keeps an unfinished head (and decodes each field once more as it goes), so
    a client that never sends the blank line pins what it sent; this bounds the sum."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.refused = RefusalLog("unfinished request headers at server.max_pending_header_bytes")

    def charge(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def release(self, n: int) -> None:
        self.held -= n


class Evictable(Protocol):
    def evict(self) -> None:
        """Answer the canned 503 and close (its connection_lost calls ``HeadWaiters.lost``)."""


class HeadWaiters:
    """The connections under one cap still waiting for their first request head, oldest first.

    At the cap the oldest of them is evicted for a newcomer, rather than the newcomer refused: a
    client that holds every slot with half-sent heads (re-opened as the header timeout closes
    them) then locks nobody out, while connections with a request in progress are never cut."""

    def __init__(self) -> None:
        self._waiting: dict[Evictable, None] = {}  # insertion order: the oldest first
        self.evicting = 0  # evicted, their connection_lost not yet called (still counted open)

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, handler: Evictable) -> None:
        self._waiting[handler] = None

    def discard(self, handler: Evictable) -> None:
        self._waiting.pop(handler, None)

    def evict_oldest(self) -> bool:
        """Evict the oldest waiting connection; False when there is none."""
        for handler in self._waiting:
            del self._waiting[handler]
            self.evicting += 1
            handler.evict()
            return True
        return False

    def lost(self) -> None:
        """An evicted connection is gone (no longer counted open)."""
        self.evicting -= 1


ADDRESS_OVER_SHARE = canned(
    "503 Service Unavailable",
    "too_many_connections",
    "This address holds its share of the proxy's open connections; retry shortly.",
    "Retry-After: 1\r\n",
)


class AddressShare:
    """Open connections per client address under one cap (``server.max_connections_per_address``;
    None: no share). Clients behind one NAT or load balancer share an address, hence off by
    default."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}
        self.refused = RefusalLog(f"an address at its share of {limit} connections")

    def admit(self, address: str) -> bool:
        held = self.open.get(address, 0)
        if self.limit is not None and held >= self.limit:
            self.refused.refused()
            return False
        self.open[address] = held + 1
        return True

    def release(self, address: str) -> None:
        held = self.open.pop(address, 0) - 1
        if held > 0:
            self.open[address] = held


class Admission:
    """What a new connection passes once its address is known: the address share, then, when it
    came at the cap, room made by an eviction (``make_room``: False when there was none)."""

    def __init__(self, share: AddressShare, make_room: Callable[[], bool] | None = None) -> None:
        self.share = share
        self.make_room = make_room

    def admit(self, transport: asyncio.BaseTransport) -> tuple[bytes | None, str | None]:
        """(the canned refusal or None, the address counted in the share or None)."""
        address: str | None = None
        if self.share.limit is not None:
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            if not self.share.admit(address):
                return ADDRESS_OVER_SHARE, None
        if self.make_room is not None and not self.make_room():
            if address is not None:
                self.share.release(address)
            return OVER_CAPACITY, None
        return None, address
