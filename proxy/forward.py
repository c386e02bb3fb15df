"""The upstream call and the relay back to the client.

Streaming responses are relayed event by event as they arrive; the client's response is only
started once the first event is in hand, so a backend that fails before that can still be
retried elsewhere. Whatever happens after bytes reached the client ends the stream with an
error event and ``[DONE]``, never a silent cut. Leaving this code by cancellation (the client
went away) closes the upstream connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy import sse
from proxy.errors import ProxyError, execution_timeout, upstream_failed
from proxy.outcome import Outcome

DONE_EVENT = b"data: [DONE]\n\n"


class UpstreamUnavailable(Exception):
    """The backend failed before anything reached the client: safe to retry elsewhere."""

    def __init__(
        self, kind: str, detail: str, status: int | None = None, body: bytes | None = None
    ) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.status = status
        self.body = body


@dataclass
class RelayResult:
    """What the caller needs for accounting and metrics."""

    response: web.StreamResponse
    outcome: Outcome  # ok | backend_error | client_error | upstream_error | timeout | client_gone
    status: int
    usage: dict[str, Any] | None = None
    first_token_at: float | None = None
    backend_failed: bool = False  # counts toward passive ejection
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UpstreamCall:
    session: aiohttp.ClientSession
    url: str
    body: bytes
    headers: Mapping[str, str]
    deadline: float  # loop time
    timeout_s: float  # the tier's limit, for messages
    strip_usage_chunk: bool  # the proxy asked for usage; the client did not


async def relay(
    call: UpstreamCall, request: web.Request, *, stream: bool, now: Callable[[], float]
) -> RelayResult:
    try:
        async with asyncio.timeout_at(call.deadline):
            resp = await _open(call)
    except TimeoutError:
        raise execution_timeout(call.timeout_s) from None
    async with resp:
        if resp.status == 503:
            body = await _read_bounded(resp, call.deadline)
            raise UpstreamUnavailable("503", "backend overloaded", status=503, body=body)
        if resp.status != 200 or not stream:
            return await _relay_whole(call, resp, request)
        return await _relay_stream(call, resp, request, now)


async def _open(call: UpstreamCall) -> aiohttp.ClientResponse:
    try:
        return await call.session.post(call.url, data=call.body, headers=call.headers)
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnavailable("connect", str(exc)) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc


async def _read_bounded(resp: aiohttp.ClientResponse, deadline: float) -> bytes:
    try:
        async with asyncio.timeout_at(deadline):
            return await resp.read()
    except (TimeoutError, aiohttp.ClientError):
        return b""


def _response_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    headers = {"Content-Type": resp.headers.get("Content-Type", "application/json")}
    if "X-Request-Id" in resp.headers:
        headers["X-Request-Id"] = resp.headers["X-Request-Id"]
    return headers


async def _relay_whole(
    call: UpstreamCall, resp: aiohttp.ClientResponse, request: web.Request
) -> RelayResult:
    try:
        async with asyncio.timeout_at(call.deadline):
            body = await resp.read()
    except TimeoutError:
        raise execution_timeout(call.timeout_s) from None
    except (
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientPayloadError,
        aiohttp.ClientOSError,
    ) as exc:
        # Nothing reached the client yet.
        raise UpstreamUnavailable("reset", str(exc)) from exc
    usage = None
    if resp.status == 200:
        usage = _usage_of(body)
    out = web.Response(status=resp.status, body=body, headers=_response_headers(resp))
    outcome = (
        Outcome.OK
        if resp.status < 400
        else (Outcome.BACKEND_ERROR if resp.status >= 500 else Outcome.CLIENT_ERROR)
    )
    return RelayResult(out, outcome, resp.status, usage=usage, backend_failed=resp.status >= 500)


def _usage_of(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = parsed.get("usage") if isinstance(parsed, dict) else None
    return usage if isinstance(usage, dict) else None


def _is_usage_chunk(event: bytes) -> bool:
    return b'"choices":[]' in event and b'"usage"' in event


async def _relay_stream(
    call: UpstreamCall,
    resp: aiohttp.ClientResponse,
    request: web.Request,
    now: Callable[[], float],
) -> RelayResult:
    events = sse.events(resp).__aiter__()
    # Hold the client's response until the first event: a failure before it can be retried.
    try:
        async with asyncio.timeout_at(call.deadline):
            first = await anext(events)
    except TimeoutError:
        raise execution_timeout(call.timeout_s) from None
    except StopAsyncIteration:
        raise UpstreamUnavailable("reset", "stream ended before its first event") from None
    except (
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
    ) as exc:
        raise UpstreamUnavailable("reset", str(exc)) from exc

    out = web.StreamResponse(status=200, headers=_response_headers(resp))
    out.headers["Content-Type"] = "text/event-stream"
    out.headers["Cache-Control"] = "no-cache"
    result = RelayResult(out, Outcome.OK, 200, first_token_at=now())
    try:
        await out.prepare(request)
        event: bytes | None = first
        saw_done = False
        while event is not None:
            if event.startswith(DONE_EVENT[:12]):
                saw_done = True
            if _is_usage_chunk(event):
                result.usage = _usage_of(event.removeprefix(b"data: ").strip())
                if call.strip_usage_chunk:
                    event = None
            if event is not None:
                await out.write(event)
            async with asyncio.timeout_at(call.deadline):
                event = await anext(events, None)
        if not saw_done:
            result.outcome, result.backend_failed = Outcome.UPSTREAM_ERROR, True
            await out.write(
                upstream_failed("The backend ended the stream without [DONE].").sse_event()
            )
    except TimeoutError:
        result.outcome = Outcome.TIMEOUT
        await _try_write(out, execution_timeout(call.timeout_s))
    except (
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
    ) as exc:
        result.outcome, result.backend_failed = Outcome.UPSTREAM_ERROR, True
        await _try_write(out, upstream_failed(f"The backend failed mid-stream: {exc}"))
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        result.outcome = Outcome.CLIENT_GONE
    if result.outcome != Outcome.CLIENT_GONE:
        try:
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            result.outcome = Outcome.CLIENT_GONE
    return result


async def _try_write(out: web.StreamResponse, error: ProxyError) -> None:
    with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
        await out.write(error.sse_event())
