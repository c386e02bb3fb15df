"""The relay of a non-stream answer (and of any answer that is not a 200 stream).

Held whole in memory, against the memory budget, up to ``buffer_response_bytes``
(``proxy.relay.held``); beyond it, or over the budget, streamed through a chunk at a time.
Past ``max_response_bytes`` before any byte reached the client it is this request's 502, its
usage scanned from the rest of the body (vLLM computed it all).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from proxy.api.errors import ProxyError, execution_timeout, upstream_failed
from proxy.api.outcome import Outcome
from proxy.relay.clientsend import ClientSender, ClientStalled
from proxy.relay.held import held_response
from proxy.relay.result import RelayResult, UpstreamCall, UpstreamUnavailable
from proxy.relay.sse import EventTooLarge
from proxy.relay.upstreamio import (
    CLIENT_LEFT,
    ENGINE_DEAD,
    UPSTREAM_BROKE,
    read_chunk,
    response_headers,
    too_large,
)
from proxy.relay.usagescan import UsageScan, is_error_body, usage_of_body


async def relay_whole(
    call: UpstreamCall, resp: aiohttp.ClientResponse, send: ClientSender
) -> RelayResult:
    bounds = call.bounds
    if resp.content_length is not None and resp.content_length > bounds.max_response_bytes:
        return await _too_large_answer(call, resp, UsageScan())
    try:
        async with asyncio.timeout_at(call.deadline):
            body, whole = await _read_head(resp, bounds.buffer_response_bytes)
    except TimeoutError:
        call.delivered.deadline_cut = True  # its head came: vLLM ran it whole, or nearly
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
    out = held_response(resp.status, body, response_headers(call, resp), held)
    usage = usage_of_body(body) if resp.status == 200 else None
    return RelayResult(
        out,
        _outcome_of_status(resp.status),
        resp.status,
        usage=usage,
        backend_failed=resp.status >= 500,
    )


def _fault(err: ProxyError) -> RelayResult:
    """A backend fault before any byte reached the client, not to be retried: 502."""
    return RelayResult(err.response(), Outcome.UPSTREAM_ERROR, err.status, backend_failed=True)


async def _too_large_answer(
    call: UpstreamCall, resp: aiohttp.ClientResponse, scan: UsageScan
) -> RelayResult:
    """A non-stream answer past ``max_response_bytes`` before any byte reached the client:
    its 502, and its usage from the rest of the body (vLLM computed it all)."""
    result = too_large(call.bounds.max_response_bytes)
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
            chunk = await read_chunk(resp, call.deadline)
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


async def _stream_through(
    call: UpstreamCall, resp: aiohttp.ClientResponse, send: ClientSender, head: bytes
) -> RelayResult:
    """A large non-stream answer, relayed chunk by chunk, its usage picked up on the way.
    A failure after its start can only cut the connection: JSON has no error event."""
    out = web.StreamResponse(status=resp.status, headers=response_headers(call, resp))
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
        while chunk := await read_chunk(resp, call.deadline):
            total += len(chunk)
            scan.feed(chunk)  # first: the chunk past the limit may hold the usage
            call.delivered.usage = scan.usage  # before a write the client may never let end
            if total > limit:
                raise EventTooLarge(limit)
            await send.write(out, chunk)
        call.release_backend(result.engine_ran)  # read whole: its room is handed on
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
        # Cut before it (its client stalled or gone, the deadline, the backend broke): its
        # reservation. The rest is not read then: the client's connection is gone, and with
        # it this handler (aiohttp cancels it; the bill is made from ``Delivered`` then).
        usage = await _scan_rest(call, resp, scan) if result.oversize else None
        result.usage = call.delivered.usage = usage or scan.usage
        result.usage_lost = result.usage is None and result.outcome is not Outcome.OK
    return result
