"""At the connection cap, the oldest connection still waiting for its first request head is
evicted for a newcomer (``server.evict_at_cap``, issue 22 #10): one unauthenticated client that
holds every slot with half-sent heads, re-opening each as it closes, locked paying clients out
(38 of 39 refused). Connections with a request in progress are never evicted. Against the
served proxy (uvloop, the C parser) with the kit's realistic clients."""

from __future__ import annotations

import asyncio
import contextlib

from tests.adversarial.served.conftest import StartServed
from tests.adversarial.served.kit import (
    ClosedEarly,
    RawClient,
    crowd,
    exchange,
    json_request,
    realistic_socket,
)
from tests.adversarial.served.test_cap import CAP, UPLOAD_REST, fill_the_cap
from tests.proxyrun import KEYS

HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
CHAT = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def test_one_client_holding_every_slot_with_half_heads_locks_nobody_out(
    start_served: StartServed,
) -> None:
    proxy = start_served(server={"max_connections": CAP, "header_timeout_s": 5})
    mark = proxy.mark()
    held = await crowd(proxy.host, proxy.port, CAP, payload=HALF_HEAD)
    stop = asyncio.Event()

    async def reopen() -> None:  # as the attacker does: each closed slot taken again at once
        while not stop.is_set():
            with contextlib.suppress(OSError, TimeoutError, ClosedEarly):
                client = await RawClient.connect(proxy.host, proxy.port)
                try:
                    await client.send(HALF_HEAD)
                    await client.closed_by_peer(10)
                finally:
                    client.close()

    attackers = [asyncio.create_task(reopen()) for _ in range(CAP)]
    try:
        statuses = []
        for _ in range(20):
            answer = await exchange(
                proxy.host, proxy.port, json_request("/v1/chat/completions", CHAT, KEYS["high"])
            )
            statuses.append(answer.status)
        assert statuses == [200] * 20, statuses
        evicted = await held.answers(timeout_s=5)  # the oldest were told why, in JSON
        codes = {a.error_code() for a in evicted if a is not None}
        assert codes == {"too_many_connections"}, codes
    finally:
        stop.set()
        held.close()
        for task in attackers:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)
    assert proxy.tracebacks(mark) == 0
    assert proxy.count(r"connection\(s\) evicted", mark) >= 1


async def test_requests_in_progress_are_never_evicted(start_served: StartServed) -> None:
    proxy = start_served(server={"max_connections": CAP})
    held = await fill_the_cap(proxy)  # CAP uploads, each halfway through its body
    try:
        for _ in range(5):
            over = await exchange(proxy.host, proxy.port, json_request("/v1/models", {}, None))
            assert over.status == 503 and over.error_code() == "too_many_connections"
        for client in held.clients:  # each upload ends: its request is answered, not cut
            await client.send(UPLOAD_REST)
        answers = [await client.read_response() for client in held.clients]
        assert [a.status for a in answers] == [200] * CAP, [a.body[:200] for a in answers]
    finally:
        held.close()


async def connect_from(source: str, host: str, port: int) -> RawClient:
    """A realistic client connecting from ``source`` (another loopback address)."""
    sock = realistic_socket()
    sock.bind((source, 0))
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), 5)
    except BaseException:
        sock.close()
        raise
    return RawClient(sock)


async def test_an_address_past_its_share_is_refused_and_others_are_served(
    start_served: StartServed,
) -> None:
    """``server.max_connections_per_address`` (off by default: NAT and load balancers)."""
    proxy = start_served(server={"max_connections": CAP, "max_connections_per_address": 5})
    mark = proxy.mark()
    held = await crowd(proxy.host, proxy.port, 5, payload=HALF_HEAD)  # from 127.0.0.1
    try:
        over = await exchange(proxy.host, proxy.port, json_request("/v1/models", {}, None))
        assert over.status == 503 and over.error_code() == "too_many_connections"
        assert b"This address" in over.body
        other = await connect_from("127.0.0.2", proxy.host, proxy.port)
        try:
            await other.send(json_request("/v1/chat/completions", CHAT, KEYS["high"]))
            assert (await other.read_response()).status == 200
        finally:
            other.close()
    finally:
        held.close()
    # The share is given back as connections close.
    deadline = asyncio.get_running_loop().time() + 5
    while (
        await exchange(
            proxy.host, proxy.port, json_request("/v1/chat/completions", CHAT, KEYS["high"])
        )
    ).status != 200:
        assert asyncio.get_running_loop().time() < deadline, "the share was never given back"
    assert proxy.tracebacks(mark) == 0
