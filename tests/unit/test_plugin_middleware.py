"""The ticket middleware: body rewriting rules and the ASGI contract (no server, no network)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from proxy.ticket import (
    TICKET_HEADER,
    XARG_BUDGET,
    XARG_DEADLINE,
    XARG_PREFILL_SHARE,
    XARG_PRIORITY,
    XARG_TIER,
    XARG_TRUSTED,
    Ticket,
    encode_ticket,
)
from proxy.vllm_plugin.middleware import Message, TicketMiddleware, check_ticket, rewrite_body
from proxy.vllm_plugin.settings import MiddlewareSettings

SECRET = b"s3cret"
CHAT = "/v1/chat/completions"


def ticket(**over: Any) -> Ticket:
    fields: dict[str, Any] = {
        "tier": "high",
        "priority": 0,
        "tenant": "acme",
        "deadline": time.time() + 60,
        "prefill_share": 1.0,
        "budget": 100,
        "request_id": "req-1",
    }
    fields.update(over)
    return Ticket(**fields)


# ---- rewrite_body ------------------------------------------------------------------------------


def test_ticket_sets_priority_xargs_and_drops_caller_tierproxy_xargs() -> None:
    t = ticket()
    body = {
        "model": "tiny",
        "priority": -1000,
        "max_tokens": 50,
        "vllm_xargs": {"tierproxy_priority": -1000, "tierproxy_deadline": 9e99, "mine": "x"},
    }
    out = rewrite_body(body, t, path=CHAT, unticketed_priority=10)
    assert out["priority"] == 0
    assert out["max_tokens"] == 50
    assert out["vllm_xargs"] == {
        "mine": "x",
        XARG_TIER: "high",
        XARG_PRIORITY: 0,
        XARG_DEADLINE: t.deadline,
        XARG_PREFILL_SHARE: 1.0,
        XARG_BUDGET: 100,
        XARG_TRUSTED: 1,
    }
    assert body["priority"] == -1000  # input untouched


def test_unticketed_gets_lowest_priority_and_no_tierproxy_xargs() -> None:
    body = {"priority": -1000, "vllm_xargs": {"tierproxy_trusted": 1, "tierproxy_tier": "high"}}
    out = rewrite_body(body, None, path=CHAT, unticketed_priority=10)
    assert out["priority"] == 10
    assert "vllm_xargs" not in out
    out = rewrite_body({"messages": []}, None, path=CHAT, unticketed_priority=7)
    assert out["priority"] == 7


def test_budget_clamps_every_budget_field_or_sets_one() -> None:
    t = ticket(budget=64)
    out = rewrite_body(
        {"max_tokens": 1000, "max_completion_tokens": 10}, t, path=CHAT, unticketed_priority=10
    )
    assert (out["max_tokens"], out["max_completion_tokens"]) == (64, 10)
    assert rewrite_body({}, t, path="/v1/completions", unticketed_priority=10)["max_tokens"] == 64
    out = rewrite_body({}, t, path="/v1/responses", unticketed_priority=10)
    assert out["max_output_tokens"] == 64 and "max_tokens" not in out


def test_pooling_paths_only_get_priority_enforced() -> None:
    body = {"priority": -5, "input": "x"}
    out = rewrite_body(body, None, path="/pooling", unticketed_priority=10)
    assert out == {"priority": 10, "input": "x"}
    out = rewrite_body({"input": "x"}, None, path="/v1/embeddings", unticketed_priority=10)
    assert out == {"input": "x"}


def test_check_ticket() -> None:
    t = ticket()
    good = encode_ticket(t, SECRET)
    assert check_ticket([good], SECRET) == (t, None)
    assert check_ticket([], SECRET) == (None, "missing ticket")
    assert check_ticket([good, good], SECRET)[0] is None
    assert check_ticket([encode_ticket(ticket(), b"other")], SECRET)[0] is None
    assert check_ticket([good], b"")[0] is None  # no secret configured: nothing is trusted
    payload, sig = good.split(".")[1:]
    forged = encode_ticket(ticket(priority=-1000), b"guess").split(".")[1]
    assert check_ticket([f"v1.{forged}.{sig}"], SECRET)[0] is None
    assert check_ticket([f"v1.{payload}.{sig}"], SECRET)[0] is not None


# ---- ASGI ---------------------------------------------------------------------------------------


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


def mw_with(app: App, require: bool = False) -> TicketMiddleware:
    return TicketMiddleware(
        app, MiddlewareSettings(secret=SECRET, unticketed_priority=10, require_ticket=require)
    )


async def test_asgi_rewrites_body_strips_headers_and_keeps_disconnect() -> None:
    app = App(listen_after=True)
    body = json.dumps({"model": "tiny", "priority": -1000, "max_tokens": 500}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-vllm-priority", b"-1000"),
        (TICKET_HEADER.lower().encode(), encode_ticket(ticket(priority=3), SECRET).encode()),
    ]
    await call(mw_with(app), body, headers, chunks=3)
    seen = json.loads(app.body)
    assert seen["priority"] == 3 and seen["max_tokens"] == 100
    names = {k for k, _ in app.scope["headers"]}
    assert b"x-vllm-priority" not in names and TICKET_HEADER.lower().encode() not in names
    assert dict(app.scope["headers"])[b"content-length"] == str(len(app.body)).encode()
    assert app.after == {"type": "http.disconnect"}  # later receive() reaches the server's own


async def test_asgi_unticketed_runs_at_lowest_priority() -> None:
    app = App()
    body = json.dumps({"priority": -1000}).encode()
    await call(mw_with(app), body, [(b"x-vllm-priority", b"-1000")])
    assert json.loads(app.body)["priority"] == 10
    assert all(k != b"x-vllm-priority" for k, _ in app.scope["headers"])


@pytest.mark.parametrize(
    ("header", "status"),
    [(None, 401), (b"v1.forged.sig", 403)],
)
async def test_asgi_refuses_without_valid_ticket_when_required(
    header: bytes | None, status: int
) -> None:
    app = App()
    headers = [(TICKET_HEADER.lower().encode(), header)] if header else []
    _, sent = await call(mw_with(app, require=True), b"{}", headers)
    assert app.scope == {}  # never reached vLLM
    assert sent[0]["status"] == status
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == status and "ticket" in err["message"]


async def test_asgi_passes_other_routes_and_methods_untouched() -> None:
    app = App(listen_after=True)
    received, _ = await call(mw_with(app, require=True), b"", [], path="/v1/models", method="GET")
    assert app.body == b"" and app.after == {"type": "http.disconnect"}
    assert len(received) == 2  # nothing buffered by us


async def test_asgi_invalid_json_is_left_for_vllm_to_reject() -> None:
    app = App()
    await call(mw_with(app), b"{not json", [])
    assert app.body == b"{not json"


async def test_asgi_client_gone_before_body_runs_nothing() -> None:
    app = App()
    mw = mw_with(app)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(msg: Message) -> None:
        raise AssertionError("nothing to send")

    await mw({"type": "http", "method": "POST", "path": CHAT, "headers": []}, receive, send)
    assert app.scope == {}
