"""The relay of a streamed Responses API answer (``POST /v1/responses`` with ``stream``).

Its events differ from chat's: each is ``event: response.<kind>`` plus ``data: {...}``, the
usage comes inside the last one (``response.completed``, ``.incomplete`` or ``.failed``) and
no ``[DONE]`` follows: the stream ends when the backend closes it. A stream that closes before
its last event, times out or breaks ends with the API's own ``error`` event. Everything else
(bounds, retries before the first byte, a client that stalls or leaves) as ``proxy.relay.forward``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.api.errors import ProxyError, execution_timeout, upstream_failed, upstream_too_large
from proxy.api.outcome import Outcome
from proxy.relay import sse
from proxy.relay.clientsend import ClientSender, ClientStalled
from proxy.relay.forward import finish_stream, relay, upstream_done
from proxy.relay.result import RelayResult, UpstreamCall, UpstreamUnavailable
from proxy.relay.upstreamio import CLIENT_LEFT, ENGINE_DEAD, UPSTREAM_BROKE, open_relay, settled
from proxy.ticket import REQUEST_ID_HEADER

# The last event of a Responses stream: each carries the whole response, its usage included.
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
# What vLLM sends as soon as it takes a Responses stream, before the engine has checked the
# request: a stream that breaks after these alone was refused (an out-of-vocab logit_bias,
# red team 2026-12-06: no error event, no final event), not cut mid-generation.
OPENING_EVENTS = frozenset({"response.created", "response.in_progress"})


async def relay_responses(
    call: UpstreamCall, request: web.Request, *, stream: bool, now: Callable[[], float]
) -> RelayResult:
    """``proxy.relay.forward.relay`` for /v1/responses: a non-stream answer is an ordinary JSON
    one."""
    if not stream:
        return await relay(call, request, stream=False, now=now)
    async with open_relay(call, request) as (resp, send):
        if resp.status != 200:
            return settled(resp, await _relay_refusal(call, resp))
        return settled(resp, await _relay_events(call, resp, send, now))


async def _relay_refusal(call: UpstreamCall, resp: aiohttp.ClientResponse) -> RelayResult:
    """A non-200 answer (vLLM's JSON error), whole; 503 and a dead engine are retried."""
    try:
        async with asyncio.timeout_at(call.deadline):
            body = await resp.content.read(call.bounds.buffer_response_bytes)
    except TimeoutError:
        raise execution_timeout(call.timeout_s) from None
    except UPSTREAM_BROKE as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc
    if resp.status == 503:
        raise UpstreamUnavailable("503", "backend overloaded", status=503, body=body)
    if resp.status == 500 and ENGINE_DEAD in body:
        raise UpstreamUnavailable("engine_dead", "the backend's engine died", status=500)
    failed = resp.status >= 500
    if failed and not _is_json(body):
        err = upstream_failed(f"The backend answered {resp.status} without a JSON error.")
        return RelayResult(err.response(), Outcome.UPSTREAM_ERROR, 502, backend_failed=True)
    content_type = resp.headers.get("Content-Type", "application/json")
    out = web.Response(status=resp.status, body=body, headers={"Content-Type": content_type})
    outcome = Outcome.BACKEND_ERROR if failed else Outcome.CLIENT_ERROR
    return RelayResult(out, outcome, resp.status, backend_failed=failed)


async def _relay_events(
    call: UpstreamCall, resp: aiohttp.ClientResponse, send: ClientSender, now: Callable[[], float]
) -> RelayResult:
    events = sse.bounded_events(resp, call.bounds.max_event_bytes).__aiter__()
    try:  # the client's response waits for the first event: a failure before it is retried
        async with asyncio.timeout_at(call.deadline):
            first = await anext(events)
    except TimeoutError:
        call.delivered.deadline_cut = True  # vLLM took it (its head came): prefilling at least
        raise execution_timeout(call.timeout_s) from None
    except StopAsyncIteration:
        raise UpstreamUnavailable("reset", "stream ended before its first event") from None
    except sse.EventTooLarge as exc:
        # The request chose the size (a final event carries the whole response): its 502, not
        # the backend's failure (proxy.relay.upstreamio.too_large).
        err = upstream_too_large(exc.limit)
        return RelayResult(err.response(), Outcome.UPSTREAM_ERROR, 502, oversize=True)
    except UPSTREAM_BROKE as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc

    out = web.StreamResponse(status=200)
    out.headers["Content-Type"] = "text/event-stream"
    out.headers["Cache-Control"] = "no-cache"
    out.headers["X-Request-Id"] = call.reply_request_id or call.headers.get(REQUEST_ID_HEADER, "")
    result = RelayResult(out, Outcome.OK, 200, first_token_at=now())
    last: ProxyError | None = None
    ended = False  # the final event was written
    opened_only = True  # nothing but the opening events came yet
    try:
        await send.prepare(out)
        event: bytes | None = first
        while event is not None:
            kind, data = _kind_and_data(event)
            opened_only = opened_only and kind in OPENING_EVENTS
            if kind in FINAL_EVENTS:
                ended = True
                result.usage = call.delivered.usage = _usage_of(data)
            call.delivered.responses_event(event)  # the engine's, before the write
            call.delivered.writing = True
            await send.write(out, event)
            call.delivered.writing = False
            if ended:  # nothing follows the final event: end without the backend's close
                break
            async with asyncio.timeout_at(call.deadline):
                event = await anext(events, None)
        if not ended:
            result.outcome, result.backend_failed = Outcome.UPSTREAM_ERROR, True
            last = upstream_failed("The backend ended the stream before its last event.")
    except ClientStalled:
        result.outcome, result.status = Outcome.CLIENT_STALLED, 499
    except CLIENT_LEFT:
        result.outcome = Outcome.CLIENT_GONE
    except TimeoutError:
        result.outcome, last = Outcome.TIMEOUT, execution_timeout(call.timeout_s)
    except sse.EventTooLarge as exc:
        result.outcome, last = Outcome.UPSTREAM_ERROR, upstream_too_large(exc.limit)
        result.oversize = True
    except UPSTREAM_BROKE as exc:
        result.outcome, result.backend_failed = Outcome.UPSTREAM_ERROR, True
        last = upstream_failed(f"The backend failed mid-stream: {exc}")
    if result.outcome is Outcome.UPSTREAM_ERROR and opened_only and not result.oversize:
        # Broken (or ended) after its opening events alone: vLLM's refusal, no engine work
        # and not the backend's failure (a tenant could repeat it at will).
        result.outcome, result.backend_failed, result.refused_in_stream = (
            Outcome.CLIENT_ERROR,
            False,
            True,
        )
    if result.outcome not in (Outcome.CLIENT_GONE, Outcome.CLIENT_STALLED):
        upstream_done(call, resp, result, whole=ended)
        tail = error_event(last) if last is not None else b""
        await finish_stream(send, out, tail, result, whole=ended)
    return result


def error_event(err: ProxyError) -> bytes:
    """The Responses API's ``error`` event, which ends a stream."""
    payload = {"type": "error", "code": err.code, "message": err.message, "param": err.param}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


def _kind_and_data(event: bytes) -> tuple[str | None, bytes | None]:
    kind = None
    for line in event.splitlines():
        if line.startswith(b"event:"):
            kind = line[6:].strip().decode("utf-8", "replace")
    return kind, sse.event_data(event)


def _usage_of(data: bytes | None) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(data or b"")
    except orjson.JSONDecodeError:
        return None
    response = parsed.get("response") if isinstance(parsed, dict) else None
    usage = response.get("usage") if isinstance(response, dict) else None
    return usage if isinstance(usage, dict) else None


def _is_json(body: bytes) -> bool:
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return True
