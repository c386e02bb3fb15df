"""The backend's side of a relay: opening its answer under the call's deadline, reading it
bounded, what its faults look like, and the headers the client's response takes from it.

Shared by the stream relay (``proxy.relay.forward``), the non-stream one
(``proxy.relay.whole``) and /v1/responses' (``proxy.relay.responses``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from proxy.api.errors import upstream_too_large
from proxy.api.outcome import Outcome
from proxy.relay.clientsend import ClientSender
from proxy.relay.delivered import Delivered
from proxy.relay.result import NoAnswerHead, RelayResult, UpstreamCall, UpstreamUnavailable
from proxy.ticket import REQUEST_ID_HEADER

# What vLLM's EngineDeadError says (vllm/v1/engine/exceptions.py), answered as a 500 before any
# byte when the engine core died. The request may be what killed it (a poison pill): retried
# within the reset bound, never when it ran there alone (proxy.request.pipeline).
ENGINE_DEAD = b"EngineCore encountered an issue"
# What is read of an error answer (503 and the like).
_TAIL_BYTES = 64 * 1024
# The backend's connection failed: reset, closed, or an invalid HTTP answer or body.
UPSTREAM_BROKE = (
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientResponseError,
)
CLIENT_LEFT = (ConnectionResetError, aiohttp.ClientConnectionResetError)


@contextlib.asynccontextmanager
async def open_relay(
    call: UpstreamCall, request: web.Request
) -> AsyncIterator[tuple[aiohttp.ClientResponse, ClientSender]]:
    """The upstream's answer, opened within the call's deadline, and the sender to the client
    (under the same deadline and the relay's send-idle bound); both relays start here. While
    it is open the call's ``delivered.sent`` is set: only a cancellation (the client left)
    leaves it set."""
    call.delivered.sent = True
    try:
        try:
            async with asyncio.timeout_at(call.deadline):
                resp = await open_upstream(call)
        except TimeoutError:
            raise NoAnswerHead(call.timeout_s) from None
        bounds = call.bounds
        send = ClientSender(
            request, call.deadline, bounds.send_idle_timeout_s, bounds.read_ahead_bytes, call.budget
        )
        try:
            async with resp:
                yield resp, send
        finally:
            send.close()  # the read-ahead's bytes: given back whatever the end
    except Exception:
        call.delivered.sent = False  # failed (retried, or answered with an error): no bill
        raise


def settled(resp: aiohttp.ClientResponse, result: RelayResult) -> RelayResult:
    """A relay's result; an answer not read to its end is closed, never pooled again (vLLM
    aborts the request when its connection closes)."""
    if result.outcome not in (Outcome.OK, Outcome.CLIENT_ERROR, Outcome.BACKEND_ERROR):
        resp.close()
    return result


def head_sent_trace() -> aiohttp.TraceConfig:
    """The upstream session's trace of a request's head (``Delivered.head_sent``, its
    ``trace_request_ctx``): False as the request starts, True once its head is written to a
    backend's connection. Until then no backend took it, and a cut then bills nothing (red
    team, 2026-12-06: a connect hanging past the tier's limit was billed its reservation)."""

    def marking(sent: bool) -> Callable[..., Awaitable[None]]:
        async def mark(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
            if isinstance(ctx.trace_request_ctx, Delivered):
                ctx.trace_request_ctx.head_sent = sent

        return mark

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(marking(False))
    trace.on_request_headers_sent.append(marking(True))
    return trace


async def open_upstream(call: UpstreamCall) -> aiohttp.ClientResponse:
    try:
        return await call.session.post(
            call.url, data=call.body, headers=call.headers, trace_request_ctx=call.delivered
        )
    except aiohttp.ConnectionTimeoutError as exc:
        # A host gone (its SYNs dropped): the backend's fault, not the tier's time limit,
        # though aiohttp's error is also a TimeoutError.
        raise UpstreamUnavailable("connect", f"connect timed out: {exc}") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnavailable("connect", str(exc)) from exc
    except UPSTREAM_BROKE as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc


async def read_bounded(resp: aiohttp.ClientResponse, deadline: float) -> bytes:
    try:
        async with asyncio.timeout_at(deadline):
            return await resp.content.read(_TAIL_BYTES)
    except (TimeoutError, aiohttp.ClientError):
        return b""


async def read_chunk(resp: aiohttp.ClientResponse, deadline: float) -> bytes:
    async with asyncio.timeout_at(deadline):
        return await resp.content.readany()


def response_headers(call: UpstreamCall, resp: aiohttp.ClientResponse) -> dict[str, str]:
    """Set before the response is prepared: the request id the pipeline gave the call (a
    streamed response's headers cannot change once sent)."""
    headers = {"Content-Type": resp.headers.get("Content-Type", "application/json")}
    request_id = (
        call.reply_request_id
        or call.headers.get(REQUEST_ID_HEADER)
        or resp.headers.get(REQUEST_ID_HEADER)
    )
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return headers


def too_large(limit: int) -> RelayResult:
    """An answer past the relay's bounds before any byte reached the client: the request chose
    its size (echo with logprobs, prompt_logprobs, n), so it is this request's 502, never a
    failure of the backend (no ejection) and never retried on another one."""
    err = upstream_too_large(limit)
    return RelayResult(err.response(), Outcome.UPSTREAM_ERROR, err.status, oversize=True)
