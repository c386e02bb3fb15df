"""One tenant's slow uploads cannot hold every connection (fresh eyes, round 3, s01): a request
in progress is never evicted at the cap, and a tenant's rate limits need its body, so 40 uploads
of a byte at a time with a valid key locked every other tenant out (503 too_many_connections).
Its bodies coming in are bounded once its key is checked (``input.max_uploads_per_tenant``,
unset: a quarter of ``server.max_connections``); past it 429 at once, the connection closed."""

from __future__ import annotations

import asyncio

from proxy.bench.hostile.kit import ClosedEarly, crowd, exchange, json_request
from proxy.bench.hostile.served import StartServed
from proxy.bench.inproc import KEYS

CAP = 40
CHAT = {"model": "null", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}


def slow_upload_head(key: str) -> bytes:
    """A valid head announcing 100 kB, and the body's first byte: the rest never comes."""
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        "Content-Length: 100000\r\n\r\n{"
    ).encode()


async def test_one_tenants_slow_uploads_leave_room_for_the_others(
    start_served: StartServed,
) -> None:
    proxy = start_served(server={"max_connections": CAP}, input={"body_read_timeout_s": 20})
    mark = proxy.mark()
    held = await crowd(proxy.host, proxy.port, CAP, payload=slow_upload_head(KEYS["low"]))
    try:
        # A quarter of the cap reads its body on; the others are told at once and closed.
        answers = await held.answers(timeout_s=3)
        refused = [a for a in answers if a is not None]
        assert len(refused) == CAP - CAP // 4, [a.status for a in refused]
        assert {(a.status, a.error_code()) for a in refused} == {(429, "too_many_uploads")}
        assert all(a.headers.get("retry-after") == "1" for a in refused)
        for _ in range(5):  # the other tenants get in meanwhile
            answer = await exchange(
                proxy.host, proxy.port, json_request("/v1/chat/completions", CHAT, KEYS["high"])
            )
            assert answer.status == 200, answer.body[:200]
        # Closed without lingering on the rest of the body: their slots are free again.
        closed = await asyncio.gather(
            *(c.closed_by_peer(2) for c, a in zip(held.clients, answers, strict=True) if a),
            return_exceptions=True,
        )
        assert all(c is True or isinstance(c, ClosedEarly) for c in closed), closed
    finally:
        held.close()
    assert proxy.count("outcome=rate_limited", mark) == CAP - CAP // 4
    assert proxy.tracebacks(mark) == 0
