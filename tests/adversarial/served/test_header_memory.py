"""Request heads on the served proxy: bounded per connection (``server.max_header_bytes``, 431
past it, before the blank line) and all unfinished heads together
(``server.max_pending_header_bytes``, 503 past it), so hostile connections that never finish
their headers pin a bounded amount of memory, not ~2 MiB each."""

from __future__ import annotations

from proxy.bench.hostile.kit import exchange, is_openai_error, unfinished_headers
from proxy.bench.hostile.measure import MIB, header_memory, hostile_head
from proxy.bench.hostile.served import ServedProxy, StartServed


async def test_a_head_past_max_header_bytes_gets_431_json(served: ServedProxy) -> None:
    resp = await exchange(served.host, served.port, unfinished_headers())
    assert resp.status == 431 and is_openai_error(resp), resp.body[:300]
    assert resp.error_code() == "request_header_fields_too_large"


async def test_a_head_of_30_kib_in_mss_sized_reads_is_served(served: ServedProxy) -> None:
    head = hostile_head(30 * 1024)[len(b"POST /v1/chat/completions HTTP/1.1\r\n") :]
    req = b"GET /v1/models HTTP/1.1\r\n" + head + b"\r\n"  # under 32 KiB: a 401, not a 431
    resp = await exchange(served.host, served.port, req)
    assert resp.status == 401 and is_openai_error(resp), resp.body[:300]


async def test_300_connections_sending_1_mib_heads_pin_no_memory(
    start_served: StartServed,
) -> None:
    """Once: RSS 63 -> 659 MiB (~2 GiB per 1,000 connections), still 650 MiB after they closed."""
    proxy = start_served()
    figures = await header_memory(proxy, 300, unfinished_headers())
    assert figures.answers.get("431", 0) >= 290, figures.line()
    assert figures.per_1000_mib < 40, figures.line()


async def test_unfinished_heads_together_stay_within_the_budget(start_served: StartServed) -> None:
    """300 connections each holding 30 KiB (under max_header_bytes) against a 4 MiB budget:
    about 130 are held, the rest refused with 503; the memory follows the budget. A held head
    ends in a 408 once its header timeout passes, which a busy machine can reach before the
    count: held = still open + 408."""
    budget = 4 * MIB
    proxy = start_served(server={"max_pending_header_bytes": budget})
    figures = await header_memory(proxy, 300, hostile_head(30 * 1024))
    assert figures.answers.get("503", 0) >= 100, figures.line()
    held = figures.still_open + figures.answers.get("408", 0)
    assert 100 <= held <= 150, figures.line()
    assert figures.held_rss - figures.idle_rss < 4 * budget, figures.line()
