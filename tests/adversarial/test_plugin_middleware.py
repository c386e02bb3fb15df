"""The ticket middleware: body rewriting rules and the ASGI contract (no server, no network)."""

from __future__ import annotations

import json
import logging

import pytest

from proxy.ticket import (
    PLACEHOLDER_SECRETS,
    XARG_BUDGET,
    XARG_PREFILL_SHARE,
    XARG_PRIORITY,
    XARG_TIER,
    XARG_TIME_LIMIT,
    XARG_TRUSTED,
    SecretError,
    encode_ticket,
)
from proxy.vllm_plugin.clock import CLOCK_REFUSALS
from proxy.vllm_plugin.middleware import Message, TicketMiddleware, check_ticket, rewrite_body
from proxy.vllm_plugin.settings import MiddlewareSettings
from proxy.vllm_plugin.verify import ReplayCache
from tests.helpers.clock import FakeClock
from tests.helpers.plugin_asgi import (
    CHAT,
    NOW,
    RID_RAW,
    SECRET,
    TICKET_RAW,
    App,
    call,
    mw_with,
    refused,
    signed,
    ticket,
)

# ---- rewrite_body ------------------------------------------------------------------------------


def test_a_body_without_vllm_xargs_gets_the_tickets_xargs() -> None:
    """The proxy strips every client's vllm_xargs: its bodies carry none of their own."""
    t = ticket()
    out = rewrite_body({"model": "tiny", "prompt": "x"}, t, path=CHAT, unticketed_priority=10)
    assert out["vllm_xargs"][XARG_TIME_LIMIT] == 60.0  # deadline - issued_at: a duration
    assert out["vllm_xargs"][XARG_PREFILL_SHARE] == 1.0 and out["vllm_xargs"][XARG_TRUSTED] == 1


def test_ticket_sets_priority_xargs_and_drops_caller_tierproxy_xargs() -> None:
    t = ticket()
    body = {
        "model": "tiny",
        "priority": -1000,
        "max_tokens": 50,
        "vllm_xargs": {"tierproxy_priority": -1000, "tierproxy_time_limit_s": 9e99, "mine": "x"},
    }
    out = rewrite_body(body, t, path=CHAT, unticketed_priority=10)
    assert out["priority"] == 0
    assert out["max_tokens"] == 50
    assert out["vllm_xargs"] == {
        "mine": "x",
        XARG_TIER: "high",
        XARG_PRIORITY: 0,
        XARG_TIME_LIMIT: 60.0,
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


def test_other_routes_get_priority_forced_and_caller_xargs_dropped_but_no_hints() -> None:
    body = {"priority": -5, "input": "x", "vllm_xargs": {"tierproxy_trusted": 1}}
    out = rewrite_body(body, None, path="/pooling", unticketed_priority=10)
    assert out == {"priority": 10, "input": "x"}
    out = rewrite_body({"input": "x"}, None, path="/v1/embeddings", unticketed_priority=10)
    assert out == {"priority": 10, "input": "x"}  # set even where the caller left it out
    out = rewrite_body(
        {"max_tokens": 9}, ticket(priority=2), path="/invocations", unticketed_priority=10
    )
    assert out == {"max_tokens": 9, "priority": 2}  # no xargs or budget off the proxy's routes


def test_nested_extra_args_of_the_token_route_lose_our_keys() -> None:
    body = {
        "priority": -1000,
        "sampling_params": {"max_tokens": 5, "extra_args": {"tierproxy_trusted": 1, "k": 2}},
    }
    out = rewrite_body(body, None, path="/inference/v1/generate", unticketed_priority=10)
    assert out == {"priority": 10, "sampling_params": {"max_tokens": 5, "extra_args": {"k": 2}}}


def test_check_ticket() -> None:
    t = ticket()
    good = encode_ticket(t, SECRET).encode()
    assert check_ticket([good], SECRET) == (t, None)
    assert check_ticket([], SECRET) == (None, "missing ticket")
    assert check_ticket([good, good], SECRET)[0] is None
    assert check_ticket([encode_ticket(ticket(), b"other").encode()], SECRET)[0] is None
    assert check_ticket([good], b"")[0] is None  # no secret configured: nothing is trusted
    payload, sig = good.split(b".")[1:]
    forged = encode_ticket(ticket(priority=-1000), b"guess").split(".")[1].encode()
    assert check_ticket([b"v2." + forged + b"." + sig], SECRET)[0] is None
    assert check_ticket([b"v2." + payload + b"." + sig], SECRET)[0] is not None
    assert check_ticket([b"v1." + payload + b"." + sig], SECRET)[0] is None


def test_replay_cache_forgets_with_the_window_and_is_bounded() -> None:
    cache = ReplayCache(max_entries=2)
    assert cache.first_use("a", forget_at=NOW + 30, now=NOW)
    assert not cache.first_use("a", forget_at=NOW + 30, now=NOW + 29)
    assert cache.first_use("b", forget_at=NOW + 40, now=NOW + 29)
    with pytest.raises(Exception, match="replay window"):
        cache.first_use("c", forget_at=NOW + 59, now=NOW + 29)
    assert cache.first_use("c", forget_at=NOW + 60, now=NOW + 30)  # "a" has been forgotten
    assert len(cache) == 2


# ---- ASGI ---------------------------------------------------------------------------------------


async def test_asgi_rewrites_body_strips_headers_and_keeps_disconnect() -> None:
    app = App(listen_after=True)
    body = json.dumps({"model": "tiny", "priority": -1000, "max_tokens": 500}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-vllm-priority", b"-1000"),
        *signed(body, priority=3),
    ]
    await call(mw_with(app, require=True), body, headers, chunks=3)
    seen = json.loads(app.body)
    assert seen["priority"] == 3 and seen["max_tokens"] == 100
    names = {k for k, _ in app.scope["headers"]}
    assert b"x-vllm-priority" not in names and TICKET_RAW not in names
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
    [(None, 401), (b"v2.forged.sig", 403), (b"v1.old.format", 403)],
)
async def test_asgi_refuses_without_valid_ticket_when_required(
    header: bytes | None, status: int
) -> None:
    app = App()
    headers = [(TICKET_RAW, header)] if header else []
    got, err = await refused(mw_with(app, require=True), b"{}", headers)
    assert app.scope == {}  # never reached vLLM
    assert got == status and err["code"] == status and "ticket" in err["message"]


@pytest.mark.parametrize("raw", [b"v2.\xc3\xa9.\xff", b"\x80\x81", "v2.é.ß".encode()])
async def test_asgi_non_ascii_ticket_bytes_get_json_403(raw: bytes) -> None:
    app = App()
    status, err = await refused(mw_with(app, require=True), b"{}", [(TICKET_RAW, raw)])
    assert status == 403 and "ASCII" in err["message"] and app.scope == {}


async def test_asgi_replayed_ticket_is_refused() -> None:
    app = App()
    mw = mw_with(app, require=True)
    body = b'{"prompt":"hi"}'
    headers = signed(body)
    await call(mw, body, headers)
    assert json.loads(app.body)["priority"] == 0
    app.scope = {}
    status, err = await refused(mw, body, headers)
    assert status == 403 and "already used" in err["message"] and app.scope == {}


async def test_asgi_replay_without_required_tickets_runs_unticketed() -> None:
    app = App()
    mw = mw_with(app)
    body = b'{"prompt":"hi","priority":-5}'
    headers = signed(body)
    await call(mw, body, headers)
    await call(mw, body, headers)
    assert json.loads(app.body)["priority"] == 10


async def test_asgi_validity_window_is_enforced_by_the_clock() -> None:
    clock = FakeClock(NOW)
    app = App()
    mw = mw_with(app, require=True, clock=clock)
    body = b"{}"
    late = signed(body)  # issued at NOW, window 30 s
    clock.advance(30.5)
    status, err = await refused(mw, body, late)
    assert status == 403 and "expired" in err["message"]
    status, err = await refused(mw, body, signed(body, issued_at=clock.now + 60))
    assert status == 403 and "future" in err["message"]
    # A genuine ticket past its deadline goes on with it: the scheduler drops the request
    # before it runs (refusing it would run it unticketed where tickets are optional).
    await call(mw, body, signed(body, issued_at=clock.now, deadline=clock.now - 1))
    assert json.loads(app.body)["vllm_xargs"][XARG_TIME_LIMIT] == 0.0
    await call(mw, body, signed(body, issued_at=clock.now - 29))  # still inside the window
    assert json.loads(app.body)["priority"] == 0


async def test_asgi_body_tampering_is_refused_by_the_digest() -> None:
    app = App()
    body = b'{"prompt":"hi","max_tokens":5}'
    headers = signed(body)
    status, err = await refused(
        mw_with(app, require=True), b'{"prompt":"hi","max_tokens":50}', headers, chunks=2
    )
    assert status == 403 and "another body" in err["message"] and app.scope == {}


@pytest.mark.parametrize("request_ids", [[b"req-2"], [], [b"req-1", b"req-1"]])
async def test_asgi_request_id_mismatch_is_refused(request_ids: list[bytes]) -> None:
    app = App()
    body = b"{}"
    ticket_only = [h for h in signed(body) if h[0] == TICKET_RAW]
    headers = ticket_only + [(RID_RAW, rid) for rid in request_ids]
    status, err = await refused(mw_with(app, require=True), body, headers)
    assert status == 403 and "request" in err["message"].lower() and app.scope == {}


async def test_asgi_failed_checks_do_not_burn_the_genuine_nonce() -> None:
    app = App()
    mw = mw_with(app, require=True)
    body = b'{"prompt":"hi"}'
    headers = signed(body)
    await refused(mw, b'{"prompt":"evil"}', headers)  # a copy with another body first
    await call(mw, body, headers)  # the proxy's own request still runs
    assert json.loads(app.body)["priority"] == 0


async def test_asgi_full_replay_cache_refuses_with_503() -> None:
    app = App()
    mw = TicketMiddleware(
        app,
        MiddlewareSettings(secret=SECRET, require_ticket=True, replay_cache_size=1),
        clock=FakeClock(NOW),
    )
    await call(mw, b"{}", signed(b"{}"))
    status, err = await refused(mw, b"{}", signed(b"{}"))
    assert status == 503 and "replay" in err["message"]


@pytest.mark.parametrize(
    "path",
    ["/invocations", "/v1/chat/completions/batch", "/inference/v1/generate", "/tokenize", "/x"],
)
async def test_asgi_every_post_route_is_ticketed(path: str) -> None:
    app = App()
    body = json.dumps({"priority": -1000, "vllm_xargs": {"tierproxy_trusted": 1}}).encode()
    status, _ = await refused(mw_with(app, require=True), body, [], path=path)
    assert status == 401 and app.scope == {}
    await call(mw_with(app), body, [], path=path)
    assert json.loads(app.body) == {"priority": 10}


async def test_asgi_safe_methods_and_the_ping_probe_pass_untouched() -> None:
    for method, path in (("GET", "/v1/models"), ("HEAD", "/health"), ("POST", "/ping")):
        app = App(listen_after=True)
        received, _ = await call(mw_with(app, require=True), b"", [], path=path, method=method)
        assert app.body == b"" and app.after == {"type": "http.disconnect"}
        assert len(received) == 2  # nothing buffered by us


async def test_asgi_websocket_is_closed_when_tickets_are_required() -> None:
    app = App()
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(msg: Message) -> None:
        sent.append(msg)

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    await mw_with(app, require=True)(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}] and app.scope == {}


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


@pytest.mark.parametrize("secret", [b"", b"short-secret", *PLACEHOLDER_SECRETS])
def test_plugin_refuses_to_start_with_a_weak_secret(
    secret: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERPROXY_TICKET_SECRET", secret.decode())
    with pytest.raises(SecretError):
        TicketMiddleware(App())
    with pytest.raises(SecretError):
        MiddlewareSettings(secret=secret)


# ---- clocks of two hosts -------------------------------------------------------------------------


async def test_a_proxy_clock_ahead_is_warned_about_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A proxy 10 s ahead (allowed skew 5 s): its tickets are refused, and that is no longer
    silent (it was one DEBUG line per request): a WARNING with the offset, at most once a
    minute, and every refusal counted by reason on vLLM's /metrics."""
    app = App()
    mw = mw_with(app)  # tickets optional: the request runs unticketed, lowest priority
    future = CLOCK_REFUSALS.labels("future")
    before = future._value.get()
    body = b'{"prompt":"hi"}'
    with caplog.at_level(logging.DEBUG, logger="vllm.tierproxy"):
        for _ in range(5):
            await call(mw, body, signed(body, issued_at=NOW + 10))
            assert json.loads(app.body)["priority"] == 10
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "10.0 s ahead" in warnings[0].getMessage()
    assert future._value.get() - before == 5
    # One behind by more than the window is counted apart.
    expired = CLOCK_REFUSALS.labels("expired")
    before = expired._value.get()
    await call(mw, body, signed(body, issued_at=NOW - 45))
    assert expired._value.get() - before == 1


async def test_a_ticket_within_the_window_counts_nothing() -> None:
    app = App()
    mw = mw_with(app)
    counts = [CLOCK_REFUSALS.labels(r)._value.get() for r in ("future", "expired")]
    body = b'{"prompt":"hi"}'
    await call(mw, body, signed(body, issued_at=NOW + 4))  # inside the allowed skew
    assert json.loads(app.body)["priority"] == 0
    assert [CLOCK_REFUSALS.labels(r)._value.get() for r in ("future", "expired")] == counts
