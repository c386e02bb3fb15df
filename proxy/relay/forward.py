"""The upstream call and the relay back to the client.

Streaming responses are relayed a read at a time: the complete events of each read in one
write (``proxy.relay.sserelay`` finds the usage chunk, errors and ``[DONE]``); the client's response
is only started once the first event is in hand, so a backend that fails before that can still
be retried elsewhere. A non-stream answer (or any that is not a 200 stream) is relayed by
``proxy.relay.whole``; the backend's answer is opened in ``proxy.relay.upstreamio``. Whatever
happens after bytes reached the client ends the stream with an error event and ``[DONE]``,
never a silent cut. Leaving this code by cancellation (the client went away) closes the
upstream connection, which makes vLLM abort the request. A client that reads slower than the
backend writes lags within a read-ahead (``ClientSender``): once the backend's answer is read
whole, its room is handed on (``UpstreamCall.release_backend``) while the rest drains.

Bounds (``config.Relay``): every write to the client (``ClientSender``), each SSE event, the
part of a non-stream answer held in memory (beyond it the answer is streamed through) and its
total size. A backend fault before any byte reached the client is an OpenAI-shaped 502 or, where
the backend provably did not run the request, ``UpstreamUnavailable`` (retried elsewhere).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import web

from proxy.api.errors import execution_timeout, upstream_failed, upstream_too_large
from proxy.api.outcome import Outcome
from proxy.relay.clientsend import ClientSender, ClientStalled
from proxy.relay.delivered import Delivered
from proxy.relay.result import RelayResult, UpstreamCall, UpstreamUnavailable
from proxy.relay.sse import EventTooLarge
from proxy.relay.sserelay import SseRelay
from proxy.relay.upstreamio import (
    CLIENT_LEFT,
    UPSTREAM_BROKE,
    open_relay,
    read_bounded,
    response_headers,
    settled,
    too_large,
)
from proxy.relay.whole import relay_whole


async def relay(
    call: UpstreamCall, request: web.Request, *, stream: bool, now: Callable[[], float]
) -> RelayResult:
    async with open_relay(call, request) as (resp, send):
        if resp.status == 503:
            body = await read_bounded(resp, call.deadline)
            raise UpstreamUnavailable("503", "backend overloaded", status=503, body=body)
        if resp.status != 200 or not stream:
            return settled(resp, await relay_whole(call, resp, send))
        return settled(resp, await _relay_stream(call, resp, send, now))


async def _write_counted(
    send: ClientSender, out: web.StreamResponse, block: bytes, delivered: Delivered
) -> None:
    """Count a block of events as the engine's (before the write: a reader that stops is
    billed what came), then write it; ``writing`` stays set if the write never returns."""
    delivered.chunks(block)
    delivered.writing = True
    await send.write(out, block)
    delivered.writing = False


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
        call.delivered.deadline_cut = True  # vLLM took it (its head came): prefilling at least
        raise execution_timeout(call.timeout_s) from None
    except EventTooLarge as exc:
        return too_large(exc.limit)  # it ran there; it would again
    except UPSTREAM_BROKE as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc

    out = web.StreamResponse(status=200, headers=response_headers(call, resp))
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
            block = scan.feed(chunk)
            delivered.usage = scan.usage  # before a write the client may never let end
            if block:
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
    except EventTooLarge as exc:  # the request's doing, not the backend's (upstreamio.too_large)
        result.outcome, result.oversize = Outcome.UPSTREAM_ERROR, True
        last = upstream_too_large(exc.limit).sse_event()
    except UPSTREAM_BROKE as exc:
        result.outcome, result.backend_failed = Outcome.UPSTREAM_ERROR, True
        last = upstream_failed(f"The backend failed mid-stream: {exc}").sse_event()
    finally:
        expire.cancel()
    result.usage = delivered.usage = scan.usage
    if scan.error_event and result.outcome == Outcome.OK:
        result.outcome = Outcome.BACKEND_ERROR  # vLLM's error event, then [DONE]
    result.refused_in_stream = scan.refused  # the chooser keeps no trace of it
    if result.outcome not in (Outcome.CLIENT_GONE, Outcome.CLIENT_STALLED):
        upstream_done(call, resp, result, whole=scan.saw_done)
        if held := scan.take_held():  # cut short: its held terminal chunks before the end
            delivered.chunks(held)
            last = held + last
        await finish_stream(send, out, last, result, whole=scan.saw_done)
    return result


def upstream_done(
    call: UpstreamCall, resp: aiohttp.ClientResponse, result: RelayResult, *, whole: bool
) -> None:
    """The backend's part is over before the client has read it all (the read-ahead holds the
    rest): its room is handed on now. An answer cut short (timeout, oversize, broken) is closed
    first, so that vLLM aborts what it still runs before its room is counted free."""
    if not whole:
        resp.close()
    call.release_backend(result.engine_ran)


def _expire(content: aiohttp.StreamReader) -> None:
    content.set_exception(TimeoutError())


async def finish_stream(
    send: ClientSender, out: web.StreamResponse, last: bytes, result: RelayResult, *, whole: bool
) -> None:
    """The end of the client's response. ``whole``: the stream's last event (``[DONE]``,
    Responses' final event) was written: a client that closes now closes after reading it, and
    its request stays ``ok``, unless it left before reading what the read-ahead held."""
    read = False
    try:
        await send.settle()
        read = whole
        await send.finish(out, last)
    except ClientStalled:
        result.outcome, result.status = Outcome.CLIENT_STALLED, 499
    except CLIENT_LEFT:
        if not read:
            result.outcome = Outcome.CLIENT_GONE


__all__ = ["ClientStalled", "RelayResult", "UpstreamCall", "UpstreamUnavailable", "relay"]
