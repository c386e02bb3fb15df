"""Client connections (proxy.server.listeners): the cap, the header timeout, keep-alive, open files; real
listeners on loopback, raw sockets as the clients."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from proxy.bench.inproc import until
from proxy.config.server import Server
from proxy.server.listeners import Listeners
from proxy.server.open_files import raise_open_files_limit
from proxy.server.refusals import RefusalLog
from tests.helpers.timing import timer_lateness_s

GET = b"GET /ping HTTP/1.1\r\nHost: proxy\r\n\r\n"
Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _app(handler_delay_s: float = 0.0) -> web.Application:
    async def ping(request: web.Request) -> web.Response:
        if handler_delay_s:
            await asyncio.sleep(handler_delay_s)  # the app being slow, not the test waiting
        return web.json_response({"pong": True})

    app = web.Application()
    app.router.add_get("/ping", ping)
    return app


@contextlib.asynccontextmanager
async def serving(
    settings: Server, app: web.Application, on_refused: Callable[[], None] | None = None
) -> AsyncIterator[tuple[Listeners, int]]:
    async with Listeners(settings, on_refused) as listeners:
        port = await listeners.add(app, "127.0.0.1", 0)
        yield listeners, port


async def response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP response with a Content-Length: (head, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


async def closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server still sends before it closes (fails if it does not in 5 s)."""
    return await asyncio.wait_for(reader.read(), 5)


async def test_over_the_cap_a_connection_gets_503_json_and_a_slot_frees_on_close() -> None:
    settings = Server(
        max_connections=2, header_timeout_s=30, keepalive_timeout_s=30, evict_at_cap=False
    )
    refusals: list[int] = []
    async with serving(settings, _app(), on_refused=lambda: refusals.append(1)) as (
        listeners,
        port,
    ):
        held: list[Conn] = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await until(lambda: listeners.open_connections() == 2, 5, "two open connections")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await closed(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"Retry-After: 1\r\n" in answer and b'"code": "too_many_connections"' in answer
        assert listeners.gates[0].refused == 1 and refusals == [1]  # counted for /metrics

        held[0][1].close()
        await until(lambda: listeners.open_connections() == 1, 5, "a slot freed")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        head, body = await response(reader)
        assert head.startswith(b"HTTP/1.1 200 ") and body == b'{"pong": true}'
        writer.close()
        held[1][1].close()


async def test_headers_not_complete_in_time_get_408_and_the_connection_closes() -> None:
    settings = Server(header_timeout_s=0.1, keepalive_timeout_s=60)
    async with serving(settings, _app()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ping HTTP/1.1\r\nHost: pro")  # half a request, then nothing
        answer = await closed(reader)  # keep-alive (60 s) would not close it within 5 s
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "header_timeout"' in answer
        writer.close()


async def test_header_timeout_spares_slow_handlers_and_applies_again_to_the_next_request() -> None:
    settings = Server(header_timeout_s=0.1, keepalive_timeout_s=60)
    async with serving(settings, _app(handler_delay_s=0.4)) as (_, port):
        # The head must be in within 0.1 s of the connect: a busy host's stall between the two
        # (a 408 to the first request) voids a try, tried again; a timer that cut the handler
        # fails every try.
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(GET)
            head, _body = await response(reader)
            if not head.startswith(b"HTTP/1.1 408 "):
                break
            writer.close()
        assert head.startswith(b"HTTP/1.1 200 "), head  # the handler ran 4x the header timeout
        writer.write(b"GET /ping HTTP/1.1\r\n")  # the next request stalls in its headers
        assert (await closed(reader)).startswith(b"HTTP/1.1 408 ")
        writer.close()


async def test_idle_keep_alive_connections_close_after_the_keepalive_timeout() -> None:
    settings = Server(header_timeout_s=60, keepalive_timeout_s=0.1)
    async with serving(settings, _app()) as (listeners, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        head, _body = await response(reader)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await closed(reader) == b""  # idle after its answer: closed, nothing more sent
        silent, silent_writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed(silent) == b""  # never sent a byte
        await until(lambda: listeners.open_connections() == 0, 5, "no connection left")
        writer.close()
        silent_writer.close()


def test_open_files_soft_limit_is_raised_to_the_hard_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, hard, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with caplog.at_level(logging.INFO, logger="tierproxy"):
            got = raise_open_files_limit()
        assert got == resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert f"open files limit: {hard} (hard {hard})" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_header_timeouts_are_spread_over_the_last_quarter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connections opened in one burst must not all time out in one loop iteration: each timer
    falls in [0.75, 1] x header_timeout_s (here pinned to its earliest end, 0.75 x 4 s)."""
    monkeypatch.setattr("proxy.server.guarded_handler.random.random", lambda: 1.0)
    settings = Server(header_timeout_s=4.0, keepalive_timeout_s=60)
    async with serving(settings, _app()) as (_, port):
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened = loop.time()
        # A 3 s timer of the test's own beside the server's, on the same loop: as late as it.
        reference = asyncio.create_task(timer_lateness_s(3.0))
        assert (await closed(reader)).startswith(b"HTTP/1.1 408 ")
        waited = loop.time() - opened
        took_3s = await reference
        assert 2.9 <= waited < took_3s + 0.5, (waited, took_3s)  # 3 s, not the full 4 s
        writer.close()


def test_over_the_cap_on_uvloop_a_connection_gets_503_json() -> None:
    """uvloop's transports are not asyncio.Transport instances (the served proxy's loop): the
    refusal must write all the same (once an assert failed there and the client got nothing)."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> bytes:
        settings = Server(
            max_connections=1, header_timeout_s=30, keepalive_timeout_s=30, evict_at_cap=False
        )
        async with serving(settings, _app()) as (listeners, port):
            held = await asyncio.open_connection("127.0.0.1", port)
            await until(lambda: listeners.open_connections() == 1, 5, "one open connection")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(GET)
            answer = await closed(reader)
            writer.close()
            held[1].close()
            return answer

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        answer = runner.run(main())
    assert answer.startswith(b"HTTP/1.1 503 ") and b'"code": "too_many_connections"' in answer


async def test_at_the_cap_the_oldest_connection_waiting_for_a_head_is_evicted() -> None:
    """(server.evict_at_cap, the default) The newcomer is served; the oldest connection without a
    whole request head gets the 503 and is closed; one with a request in progress is never cut,
    and with no other left the newcomer is refused."""
    settings = Server(max_connections=3, header_timeout_s=30, keepalive_timeout_s=30)
    async with serving(settings, _app(handler_delay_s=0.5)) as (listeners, port):
        busy = await asyncio.open_connection("127.0.0.1", port)
        busy[1].write(GET)  # in its handler (0.5 s): a request in progress
        oldest = await asyncio.open_connection("127.0.0.1", port)
        oldest[1].write(b"GET /ping HTTP/1.1\r\n")  # half a head
        await until(lambda: listeners.open_connections() == 2, 5, "two open")
        younger = await asyncio.open_connection("127.0.0.1", port)
        await until(lambda: listeners.open_connections() == 3, 5, "the cap reached")
        newcomer = await asyncio.open_connection("127.0.0.1", port)
        evicted = await closed(oldest[0])
        assert evicted.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in evicted
        newcomer[1].write(GET)
        head, _ = await response(newcomer[0])
        assert head.startswith(b"HTTP/1.1 200 ")
        assert listeners.gates[0].evicted == 1 and listeners.gates[0].refused == 0
        head, _ = await response(busy[0])  # not cut
        assert head.startswith(b"HTTP/1.1 200 ")
        await until(lambda: listeners.open_connections() == 3, 5, "the evicted one gone")
        # At the cap again (busy and newcomer idle after their answer, younger waiting): the
        # one still waiting for its first head goes.
        last = await asyncio.open_connection("127.0.0.1", port)
        assert (await closed(younger[0])).startswith(b"HTTP/1.1 503 ")
        last[1].write(GET)
        head, _ = await response(last[0])
        assert head.startswith(b"HTTP/1.1 200 ")
        for conn in (busy, oldest, younger, newcomer, last):
            conn[1].close()


async def test_a_reserved_listener_answers_while_the_shared_cap_is_full() -> None:
    settings = Server(
        max_connections=2, header_timeout_s=30, keepalive_timeout_s=30, evict_at_cap=False
    )
    async with Listeners(settings) as listeners:
        public = await listeners.add(_app(), "127.0.0.1", 0)
        admin = await listeners.add(_app(), "127.0.0.1", 0, reserved=1)
        held = [await asyncio.open_connection("127.0.0.1", public) for _ in range(2)]
        await until(lambda: listeners.open_connections() == 2, 5, "two open connections")
        reader, writer = await asyncio.open_connection("127.0.0.1", public)
        assert (await closed(reader)).startswith(b"HTTP/1.1 503 ")
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", admin)
        writer.write(GET)
        head, _ = await response(reader)
        assert head.startswith(b"HTTP/1.1 200 ")
        # The reserved listener has its own cap (1, held now), apart from the shared one.
        second, second_writer = await asyncio.open_connection("127.0.0.1", admin)
        assert (await closed(second)).startswith(b"HTTP/1.1 503 ")
        for w in (writer, second_writer, *(conn[1] for conn in held)):
            w.close()


def test_refusals_log_one_line_per_period_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    refusals = RefusalLog("connection cap 2 reached", every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tierproxy"):
        for _ in range(1000):
            refusals.refused()
            now[0] += 0.001
        records = [r.getMessage() for r in caplog.records]
        assert len(records) == 1 and "1 connection(s) refused, 1 since start" in records[0]
        now[0] += 10.0
        refusals.refused()
    records = [r.getMessage() for r in caplog.records]
    assert len(records) == 2
    assert "1000 connection(s) refused in the last 11 s, 1001 since start" in records[1]


async def _head_answer(settings: Server, *chunks: bytes) -> bytes:
    async with serving(settings, _app()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
        answer = await closed(reader)
        writer.close()
        return answer


HEAD = b"GET /ping HTTP/1.1\r\nHost: proxy\r\n"


def _fields(n: int, size: int = 4000) -> bytes:
    return b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * size) for i in range(n))


async def test_a_head_past_max_header_bytes_gets_431_before_it_ends() -> None:
    settings = Server(max_header_bytes=16 * 1024, header_timeout_s=30, keepalive_timeout_s=0.5)
    # 5 fields of 4 KB: each under aiohttp's 8,190-byte field limit, together over 16 KiB; no
    # blank line, so aiohttp alone would wait (and keep them) until the header timeout.
    answer = await _head_answer(settings, HEAD, _fields(5))
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert b'"code": "request_header_fields_too_large"' in answer


async def test_a_head_within_max_header_bytes_is_served_in_small_pieces() -> None:
    settings = Server(max_header_bytes=16 * 1024, header_timeout_s=30, keepalive_timeout_s=0.5)
    head = HEAD + _fields(3) + b"\r\n"  # 12 KB, sent in 1,000-byte reads
    answer = await _head_answer(settings, *(head[i : i + 1000] for i in range(0, len(head), 1000)))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


async def test_unfinished_heads_past_the_budget_get_503_and_release_it() -> None:
    settings = Server(
        max_header_bytes=16 * 1024,
        max_pending_header_bytes=20 * 1024,
        header_timeout_s=30,
        keepalive_timeout_s=30,
    )
    async with serving(settings, _app()) as (listeners, port):
        _first, first_writer = await asyncio.open_connection("127.0.0.1", port)
        first_writer.write(HEAD + _fields(3))  # 12 KB held, unfinished
        await until(lambda: listeners.header_budget.held > 12000, 5, "the first head charged")
        second, second_writer = await asyncio.open_connection("127.0.0.1", port)
        second_writer.write(HEAD + _fields(3))  # 12 KB more: over the 20 KiB budget
        answer = await closed(second)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"header_memory_full" in answer
        first_writer.close()
        await until(lambda: listeners.header_budget.held == 0, 5, "the budget released")
        second_writer.close()
