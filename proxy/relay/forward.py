"""The upstream call and the relay back to the client.

Streaming responses are relayed a read at a time: the complete events of each read in one
write (``proxy.relay.sserelay`` finds the usage chunk, errors and ``[DONE]``); the client's response
is only started once the first event is in hand, so a backend that fails before that can still
be retried elsewhere. A buffered non-stream answer holds its bytes against the memory budget
until sent (``proxy.relay.held``). Whatever happens after bytes reached the client ends the
stream with an error event and ``[DONE]``, never a silent cut. Leaving this code by
cancellation (the client went away) closes the upstream connection, which makes vLLM abort
the request.

Bounds (``config.Relay``): every write to the client (``ClientSender``), each SSE event, the
part of a non-stream answer held in memory (beyond it the answer is streamed through) and its
total size. A backend fault before any byte reached the client is an OpenAI-shaped 502 or, where
the backend provably did not run the request, ``UpstreamUnavailable`` (retried elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web

from proxy.api.errors import ProxyError, execution_timeout, upstream_failed, upstream_too_large
from proxy.api.outcome import Outcome
from proxy.relay.clientsend import ClientSender, ClientStalled
from proxy.relay.delivered import Delivered
from proxy.relay.held import held_response
from proxy.relay.result import RelayResult, UpstreamCall, UpstreamUnavailable
from proxy.relay.sse import EventTooLarge
from proxy.relay.sserelay import SseRelay
from proxy.relay.usagescan import UsageScan, is_error_body, usage_of_body
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


async def relay(
    call: UpstreamCall, request: web.Request, *, stream: bool, now: Callable[[], float]
) -> RelayResult:
    async with open_relay(call, request) as (resp, send):
        if resp.status == 503:
            body = await _read_bounded(resp, call.deadline)
            raise UpstreamUnavailable("503", "backend overloaded", status=503, body=body)
        if resp.status != 200 or not stream:
            return settled(resp, await _relay_whole(call, resp, send))
        return settled(resp, await _relay_stream(call, resp, send, now))


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
            raise execution_timeout(call.timeout_s) from None
        async with resp:
            yield resp, ClientSender(request, call.deadline, call.bounds.send_idle_timeout_s)
    except Exception:
        call.delivered.sent = False  # failed (retried, or answered with an error): no bill
        raise


def settled(resp: aiohttp.ClientResponse, result: RelayResult) -> RelayResult:
    """A relay's result; an answer not read to its end is closed, never pooled again (vLLM
    aborts the request when its connection closes)."""
    if result.outcome not in (Outcome.OK, Outcome.CLIENT_ERROR, Outcome.BACKEND_ERROR):
        resp.close()
    return result


async def open_upstream(call: UpstreamCall) -> aiohttp.ClientResponse:
    try:
        return await call.session.post(call.url, data=call.body, headers=call.headers)
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnavailable("connect", str(exc)) from exc
    except UPSTREAM_BROKE as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc


async def _read_bounded(resp: aiohttp.ClientResponse, deadline: float) -> bytes:
    try:
        async with asyncio.timeout_at(deadline):
            return await resp.content.read(_TAIL_BYTES)
    except (TimeoutError, aiohttp.ClientError):
        return b""


def _response_headers(call: UpstreamCall, resp: aiohttp.ClientResponse) -> dict[str, str]:
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


def _fault(err: ProxyError) -> RelayResult:
    """A backend fault before any byte reached the client, not to be retried: 502."""
    return RelayResult(err.response(), Outcome.UPSTREAM_ERROR, err.status, backend_failed=True)


def _too_large(limit: int) -> RelayResult:
    """An answer past the relay's bounds before any byte reached the client: the request chose
    its size (echo with logprobs, prompt_logprobs, n), so it is this request's 502, never a
    failure of the backend (no ejection) and never retried on another one."""
    err = upstream_too_large(limit)
    return RelayResult(err.response(), Outcome.UPSTREAM_ERROR, err.status, oversize=True)


async def _too_large_answer(
    call: UpstreamCall, resp: aiohttp.ClientResponse, scan: UsageScan
) -> RelayResult:
    """A non-stream answer past ``max_response_bytes`` before any byte reached the client:
    its 502, and its usage from the rest of the body (vLLM computed it all)."""
    result = _too_large(call.bounds.max_response_bytes)
    if resp.status == 200:
        result.usage = await _scan_rest(call, resp, scan)
    return result


async def _scan_rest(
    call: UpstreamCall, resp: aiohttp.ClientResponse, scan: UsageScan
) -> dict[str, Any] | None:
    """The usage of an oversize answer, from the rest of its body: read a chunk at a time and
    dropped (never held, never relayed), until the usage, the body's end, ``oversize_scan_bytes``
    or the execution deadline, whichever comes first; None when it was not found."""
    budget = call.bounds.oversize_scan_bytes
    try:
        while scan.usage is None and budget > 0:
            chunk = await _read_chunk(resp, call.deadline)
            if not chunk:
                break
            budget -= len(chunk)
            scan.feed(chunk)
    except (TimeoutError, *UPSTREAM_BROKE):
        pass  # billed the reservation
    return scan.usage


def _outcome_of_status(status: int) -> Outcome:
    if status < 400:
        return Outcome.OK
    return Outcome.BACKEND_ERROR if status >= 500 else Outcome.CLIENT_ERROR


async def _read_head(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """Up to a little over ``limit`` bytes of the body, and whether that was all of it."""
    parts: list[bytes] = []
    held = 0
    while held <= limit:
        chunk = await resp.content.readany()
        if not chunk:
            return b"".join(parts), True
        parts.append(chunk)
        held += len(chunk)
    return b"".join(parts), False


async def _relay_whole(
    call: UpstreamCall, resp: aiohttp.ClientResponse, send: ClientSender
) -> RelayResult:
    bounds = call.bounds
    if resp.content_length is not None and resp.content_length > bounds.max_response_bytes:
        return await _too_large_answer(call, resp, UsageScan())
    try:
        async with asyncio.timeout_at(call.deadline):
            body, whole = await _read_head(resp, bounds.buffer_response_bytes)
    except TimeoutError:
        raise execution_timeout(call.timeout_s) from None
    except UPSTREAM_BROKE as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc  # nothing reached the client yet
    if resp.status == 500 and ENGINE_DEAD in body:
        raise UpstreamUnavailable("engine_dead", "the backend's engine died", status=500)
    if resp.status >= 500 and not is_error_body(body):
        return _fault(upstream_failed(f"The backend answered {resp.status} without a JSON error."))
    # Held until aiohttp has sent it: its bytes count against the memory budget meanwhile;
    # over the budget it is streamed through instead (only a chunk at a time is held).
    held = call.budget.try_reserve(len(body)) if whole and call.budget is not None else None
    if not whole or (call.budget is not None and held is None):
        return await _stream_through(call, resp, send, body)
    out = held_response(resp.status, body, _response_headers(call, resp), held)
    usage = usage_of_body(body) if resp.status == 200 else None
    return RelayResult(
        out,
        _outcome_of_status(resp.status),
        resp.status,
        usage=usage,
        backend_failed=resp.status >= 500,
    )


async def _stream_through(
    call: UpstreamCall, resp: aiohttp.ClientResponse, send: ClientSender, head: bytes
) -> RelayResult:
    """A large non-stream answer, relayed chunk by chunk, its usage picked up on the way.
    A failure after its start can only cut the connection: JSON has no error event."""
    out = web.StreamResponse(status=resp.status, headers=_response_headers(call, resp))
    if resp.content_length is not None:
        out.content_length = resp.content_length
    result = RelayResult(
        out, _outcome_of_status(resp.status), resp.status, backend_failed=resp.status >= 500
    )
    limit, total = call.bounds.max_response_bytes, len(head)
    scan = UsageScan()  # vLLM writes usage before prompt_logprobs & co.: not at the end
    scan.feed(head)
    try:
        await send.prepare(out)
        await send.write(out, head)
        while chunk := await _read_chunk(resp, call.deadline):
            total += len(chunk)
            scan.feed(chunk)  # first: the chunk past the limit may hold the usage
            if total > limit:
                raise EventTooLarge(limit)
            await send.write(out, chunk)
        await send.finish(out)
    except ClientStalled:
        result.outcome, result.status = Outcome.CLIENT_STALLED, 499
    except CLIENT_LEFT:
        result.outcome = Outcome.CLIENT_GONE
    except (TimeoutError, EventTooLarge, *UPSTREAM_BROKE) as exc:
        timed_out = isinstance(exc, TimeoutError)
        result.outcome = Outcome.TIMEOUT if timed_out else Outcome.UPSTREAM_ERROR
        result.oversize = isinstance(exc, EventTooLarge)
        result.backend_failed = not timed_out and not result.oversize
        send.abort()
    if resp.status == 200:
        # The answer was generated whole before its first byte came: billed whatever became
        # of its relay, as soon as its usage went by (past the size bound: read on for it).
        result.usage = await _scan_rest(call, resp, scan) if result.oversize else scan.usage
    return result


async def _write_counted(
    send: ClientSender, out: web.StreamResponse, block: bytes, delivered: Delivered
) -> None:
    """Count a block of events as the engine's (before the write: a reader that stops is
    billed what came), then write it; ``writing`` stays set if the write never returns."""
    delivered.chunks(block)
    delivered.writing = True
    await send.write(out, block)
    delivered.writing = False


async def _read_chunk(resp: aiohttp.ClientResponse, deadline: float) -> bytes:
    async with asyncio.timeout_at(deadline):
        return await resp.content.readany()


async def _relay_stream(
    call: UpstreamCall,
    resp: aiohttp.ClientResponse,
    send: ClientSender,
    now: Callable[[], float],
) -> RelayResult:
    scan = SseRelay(call.bounds.max_event_bytes, strip_usage=call.strip_usage_chunk)
    content = resp.content
    # Hold the client's response until the first event: a failure before it can be retried.
    first = b""
    try:
        async with asyncio.timeout_at(call.deadline):
            while not scan.started:
                chunk = await content.readany()
                if not chunk:  # the end: an event cut short counts, as proxy.relay.sse reads it
                    if not (first := scan.finish()):
                        raise UpstreamUnavailable("reset", "stream ended before its first event")
                    break
                first = scan.feed(chunk)
    except TimeoutError:
        raise execution_timeout(call.timeout_s) from None
    except EventTooLarge as exc:
        return _too_large(exc.limit)  # it ran there; it would again
    except UPSTREAM_BROKE as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc

    out = web.StreamResponse(status=200, headers=_response_headers(call, resp))
    out.headers["Content-Type"] = "text/event-stream"
    out.headers["Cache-Control"] = "no-cache"
    result = RelayResult(out, Outcome.OK, 200, first_token_at=now())
    last = b""  # an error event that ends the stream
    # One timer for the whole stream rather than one per read: at the deadline the next read
    # (or the one waiting) raises TimeoutError.
    expire = asyncio.get_running_loop().call_at(call.deadline, _expire, content)
    delivered = call.delivered
    try:
        await send.prepare(out)
        if first:
            await _write_counted(send, out, first, delivered)
        # Not past [DONE]: the answer is whole, the client's response ends now, not with the
        # backend's end of body that comes apart (a client that reads [DONE] and closes was
        # cut waiting for it); nothing after [DONE] is forwarded or billed. The backend's
        # connection is pooled only if its end came too (docs/performance.md: why no wait).
        while not scan.saw_done and (chunk := await content.readany()):
            if block := scan.feed(chunk):
                await _write_counted(send, out, block, delivered)
        if rest := scan.finish():
            await _write_counted(send, out, rest, delivered)
        if not scan.saw_done:
            result.outcome, result.backend_failed = Outcome.UPSTREAM_ERROR, True
            last = upstream_failed("The backend ended the stream without [DONE].").sse_event()
    except ClientStalled:
        result.outcome, result.status = Outcome.CLIENT_STALLED, 499
    except CLIENT_LEFT:
        result.outcome = Outcome.CLIENT_GONE
    except TimeoutError:
        result.outcome = Outcome.TIMEOUT
        last = execution_timeout(call.timeout_s).sse_event()
    except EventTooLarge as exc:  # the request's doing, not the backend's (see _too_large)
        result.outcome, result.oversize = Outcome.UPSTREAM_ERROR, True
        last = upstream_too_large(exc.limit).sse_event()
    except UPSTREAM_BROKE as exc:
        result.outcome, result.backend_failed = Outcome.UPSTREAM_ERROR, True
        last = upstream_failed(f"The backend failed mid-stream: {exc}").sse_event()
    finally:
        expire.cancel()
    result.usage = scan.usage
    if scan.error_event and result.outcome == Outcome.OK:
        result.outcome = Outcome.BACKEND_ERROR  # vLLM's error event, then [DONE]
    if result.outcome not in (Outcome.CLIENT_GONE, Outcome.CLIENT_STALLED):
        if held := scan.take_held():  # cut short: its held terminal chunks before the end
            delivered.chunks(held)
            last = held + last
        await finish_stream(send, out, last, result, whole=scan.saw_done)
    return result


def _expire(content: aiohttp.StreamReader) -> None:
    content.set_exception(TimeoutError())


async def finish_stream(
    send: ClientSender, out: web.StreamResponse, last: bytes, result: RelayResult, *, whole: bool
) -> None:
    """The end of the client's response. ``whole``: the stream's last event (``[DONE]``,
    Responses' final event) was written: a client that closes now closes after reading it, and
    its request stays ``ok``."""
    try:
        await send.finish(out, last)
    except ClientStalled:
        result.outcome, result.status = Outcome.CLIENT_STALLED, 499
    except CLIENT_LEFT:
        if not whole:
            result.outcome = Outcome.CLIENT_GONE


__all__ = ["ClientStalled", "RelayResult", "UpstreamCall", "UpstreamUnavailable", "relay"]
