"""The vLLM plugin's ticket middleware driven as ASGI, without a server: a downstream app that
reads like Starlette, one call through the middleware, tickets the proxy would sign."""

from __future__ import annotations

import json
from typing import Any

from proxy.ticket import REQUEST_ID_HEADER, TICKET_HEADER, Ticket, body_digest, encode_ticket
from proxy.vllm_plugin.middleware import Message, TicketMiddleware
from proxy.vllm_plugin.settings import MiddlewareSettings
from tests.helpers.clock import FakeClock

SECRET = b"the-middleware-tests-shared-secret"
CHAT = "/v1/chat/completions"
NOW = 1.8e9  # epoch seconds on the injected clock
TICKET_RAW = TICKET_HEADER.lower().encode()
RID_RAW = REQUEST_ID_HEADER.lower().encode()
_nonces = iter(range(10**9))


def ticket(**over: Any) -> Ticket:
    fields: dict[str, Any] = {
        "tier": "high",
        "priority": 0,
        "tenant": "acme",
        "deadline": NOW + 60,
        "prefill_share": 1.0,
        "budget": 100,
        "request_id": "req-1",
        "body_sha256": body_digest(b"{}"),
        "issued_at": NOW,
        "nonce": f"nonce-{next(_nonces)}",
    }
    fields.update(over)
    return Ticket(**fields)


class App:
    """A downstream app that reads the body like Starlette, then waits for a disconnect."""

    def __init__(self, listen_after: bool = False) -> None:
        self.scope: dict[str, Any] = {}
        self.body: bytes = b""
        self.after: Message | None = None
        self.listen_after = listen_after

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scope = scope
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        self.body = b"".join(chunks)
        if self.listen_after:
            self.after = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(
    mw: TicketMiddleware,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    path: str = CHAT,
    method: str = "POST",
    chunks: int = 1,
) -> tuple[list[Message], list[Message]]:
    size = max(1, len(body) // chunks)
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    incoming: list[Message] = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]
    incoming.append({"type": "http.disconnect"})
    received: list[Message] = []
    sent: list[Message] = []

    async def receive() -> Message:
        msg = incoming.pop(0)
        received.append(msg)
        return msg

    async def send(msg: Message) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    await mw(scope, receive, send)
    return received, sent


def mw_with(app: App, require: bool = False, clock: FakeClock | None = None) -> TicketMiddleware:
    return TicketMiddleware(
        app,
        MiddlewareSettings(secret=SECRET, unticketed_priority=10, require_ticket=require),
        clock=clock if clock is not None else FakeClock(NOW),
    )


def signed(body: bytes, request_id: str = "req-1", **over: Any) -> list[tuple[bytes, bytes]]:
    """The headers the proxy sends with ``body``: a ticket bound to it and its request id."""
    fields: dict[str, Any] = {"body_sha256": body_digest(body), "request_id": request_id}
    fields.update(over)
    value = encode_ticket(ticket(**fields), SECRET).encode()
    return [(TICKET_RAW, value), (RID_RAW, request_id.encode())]


async def refused(
    mw: TicketMiddleware, body: bytes, headers: list[tuple[bytes, bytes]], **kw: Any
) -> tuple[int, dict[str, Any]]:
    """Status and error object of a request the middleware answered itself."""
    _, sent = await call(mw, body, headers, **kw)
    assert sent[0]["type"] == "http.response.start"
    assert (b"content-type", b"application/json") in sent[0]["headers"]
    return sent[0]["status"], json.loads(sent[1]["body"])["error"]
