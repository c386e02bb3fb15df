"""One client connection's aiohttp handler, guarded (``proxy.server.listeners`` makes them): a
header timeout and size, a share of the budget of all unfinished heads, eviction at the cap,
and aiohttp's parser errors answered in JSON (answers in ``proxy.server.refusals``)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_request import BaseRequest

from proxy.config.server import Server
from proxy.server.json_errors import parser_detail, parser_error, where
from proxy.server.refusals import (
    HEADER_MEMORY_FULL,
    HEADER_TIMEOUT,
    OVER_CAPACITY,
    Admission,
    HeaderBudget,
    HeadWaiters,
    headers_too_large,
)

log = logging.getLogger("tierproxy")


def handler_kwargs(settings: Server) -> dict[str, Any]:
    """What every connection's aiohttp RequestHandler is made with (AppRunner kwargs)."""
    return {
        "access_log": None,  # our own access line names tenant and tier, never the key
        "handler_cancellation": True,  # a client that leaves cancels its handler
        "keepalive_timeout": settings.keepalive_timeout_s,
        # The body's Content-Encoding is decoded by proxy.request.body, bounded and answered
        # in JSON. The app's handler_args say so too, but a listener's gate makes each
        # connection's handler itself: without this aiohttp's parser decoded first (a good
        # body then twice: 400; a corrupt one failed in the C parser's payload: 500).
        "auto_decompress": False,
    }


HEADER_TIMEOUT_SPREAD = 0.25  # a header timeout falls in [0.75, 1] x header_timeout_s


class GuardedHandler(RequestHandler):
    """aiohttp's handler plus a header timeout (armed when the connection opens and when the
    first bytes of a later request arrive, disarmed when the request's headers are parsed), and
    OpenAI JSON, not plain text, for what aiohttp's parser refuses."""

    def __init__(
        self,
        manager: web.Server,
        *,
        header_timeout_s: float,
        max_header_bytes: int = 32 * 1024,
        header_budget: HeaderBudget | None = None,
        waiters: HeadWaiters | None = None,
        admission: Admission | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._waiters = waiters  # this connection is in it until its first head is parsed
        self._evicted = False
        self._admission = admission  # the address share and, at the cap, making room
        self._address: str | None = None  # counted in the address share
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._max_header_bytes = max_header_bytes
        self._header_budget = header_budget or HeaderBudget(2**62)
        self._head_bytes = 0  # of the request head being received (charged to the budget)
        self._head_tail = b""  # its last bytes: a blank line may span two reads
        self._body: Any = None  # the last parsed request's payload (a StreamReader)

    def _awaiting_request(self) -> bool:
        # aiohttp's start() waits on _waiter between requests; parsed headers resolve it.
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _arm(self) -> None:
        if self._header_timer is None:
            loop = asyncio.get_running_loop()
            # Spread over the timeout's last quarter: connections opened in one burst (a
            # reconnect storm, an idle-connection attack) then time out over seconds, not all
            # in one loop iteration that stalls every request on this core.
            delay = self._header_timeout_s * (1.0 - HEADER_TIMEOUT_SPREAD * random.random())
            self._header_timer = loop.call_later(delay, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._awaiting_request() and self.transport is not None:
            self.transport.write(HEADER_TIMEOUT)
            self.force_close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._admission is not None:
            refusal, self._address = self._admission.admit(transport)
            if refusal is not None:
                self._refuse(refusal)
                return
        self._arm()
        if self._waiters is not None:
            self._waiters.add(self)

    def evict(self) -> None:
        """Make room at the cap: this connection has not sent a whole request head yet."""
        self._evicted = True
        self._refuse(OVER_CAPACITY)

    def data_received(self, data: bytes) -> None:
        if data and self._awaiting_request():
            self._arm()
        in_head = self._in_head() and not (self._force_close or self._close)
        if in_head and not self._head_fits(data):
            self._refuse(headers_too_large(self._max_header_bytes))
            return
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:
            self._body = self._messages[-1][1]
            self._release_head()
            if self._waiters is not None:
                self._waiters.discard(self)  # a request in progress is never evicted
            self._fail_body_on_framing_error()
        elif in_head and self._in_head() and not (self._force_close or self._close):
            if not self._header_budget.charge(len(data)):
                self._header_budget.refused.refused()
                self._refuse(HEADER_MEMORY_FULL)
                return
            self._head_bytes += len(data)
            self._head_tail = (self._head_tail + data)[-3:]
        if not self._awaiting_request():
            self._disarm()

    def _in_head(self) -> bool:
        """Whether the next bytes belong to a request head (not to a body being received)."""
        body = self._body
        return body is None or body.is_eof() or body.exception() is not None

    def _head_fits(self, data: bytes) -> bool:
        """Whether ``data`` keeps the head within ``max_header_bytes`` (or ends it within)."""
        room = self._max_header_bytes - self._head_bytes
        if len(data) <= room:
            return True
        window = self._head_tail + data[: max(room, 0)]
        return b"\n\r\n" in window or b"\n\n" in window

    def _release_head(self) -> None:
        self._header_budget.release(self._head_bytes)
        self._head_bytes = 0
        self._head_tail = b""

    def _refuse(self, answer: bytes) -> None:
        """A canned answer before any request was parsed, then close."""
        self._release_head()
        # Not in the middle of another request's answer (a pipelined head): that one is cut.
        if self.transport is not None and self._current_request is None:
            self.transport.write(answer)
        self.force_close()

    def _fail_body_on_framing_error(self) -> None:
        """aiohttp's C parser, failing on framing inside a body (a bad chunk size), queues an
        error message for after the request but leaves that request's body waiting for bytes
        that never come (until the body timeout). Hand the error to the body instead: its reader
        answers 400 bad_framing, and the connection closes after that answer."""
        message, _ = self._messages[-1]
        request = self._current_request
        if not isinstance(message, _ErrInfo) or request is None or request.content.is_eof():
            return
        self._messages.pop()
        exc = message.exc
        detail = parser_detail(exc) if isinstance(exc, HttpProcessingError) else "bad framing"
        request.content.set_exception(BadHttpMessage(detail))
        request.content.feed_eof()  # nothing more to wait for (nor to linger on)
        self.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._release_head()
        if self._waiters is not None:
            self._waiters.discard(self)
            if self._evicted:
                self._waiters.lost()
            self._waiters = None
        if self._admission is not None and self._address is not None:
            self._admission.share.release(self._address)
            self._address = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp answers what its parser refuses (and what no handler answered) here, in
        plain text with a traceback in the log; this answers OpenAI JSON, logs one line and
        closes the connection (after a framing error nothing later on it can be trusted)."""
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("an answer was sent already, cannot send the error")
        err = parser_error(status, exc)
        if err.status >= 500:
            log.error(
                "unhandled %s before the app's middleware at %s: %s",
                type(exc).__name__,
                where(exc) if exc is not None else "?",
                str(exc)[:200],
            )
        else:
            log.info(
                "refused a malformed request from %s: %d %s",
                request.remote,
                err.status,
                err.message[:200],
            )
        resp = err.response()
        resp.headers["Connection"] = "close"  # aiohttp says it only to HTTP/1.1 requests
        resp.force_close()
        return resp
