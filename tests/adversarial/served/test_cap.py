"""The connection cap on the served proxy (uvloop, whose transports are not asyncio.Transport
instances): with every slot's request in progress, every refused connection gets the
documented 503 JSON, the log gets a line per ten seconds rather than a traceback per
connection, and the admin listener, with connections of its own, answers /metrics and drain
through the flood. At the cap the oldest connection still waiting for its first request head is
evicted for a newcomer (``server.evict_at_cap``, issue 22 #10): one unauthenticated client holding
every slot with half-sent heads, re-opening each as it closed, locked paying clients out (38 of
39 refused); requests in progress are never evicted; ``server.max_connections_per_address``."""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson

from proxy.bench.hostile.kit import (
    ClosedEarly,
    Crowd,
    RawClient,
    crowd,
    exchange,
    is_openai_error,
    json_request,
    realistic_socket,
    request_bytes,
)
from proxy.bench.hostile.served import ADMIN_KEY, NullBackend, ServedProxy, StartServed
from proxy.bench.inproc import KEYS
from tests.helpers.timing import polls_until

CAP = 20
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def metric(proxy: ServedProxy, name: str = "tierproxy_open_connections") -> float:
    """A sample of /metrics from the admin listener (open connections: its own included)."""
    req = request_bytes("GET", "/metrics", ADMIN)
    resp = await exchange(proxy.host, proxy.admin_port or proxy.port, req)
    assert resp.status == 200, resp.body[:300]
    for line in resp.body.decode().splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def open_connections(proxy: ServedProxy) -> float:
    return await metric(proxy)


# A request whose head is in and whose body is still coming (for input.body_read_timeout_s, 30 s):
# a request in progress, which the cap never evicts (an idle connection would be, for a newcomer).
_BODY = b'{"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1'
_BODY += b" " * (999 - len(_BODY)) + b"}"
UPLOAD_REST = _BODY[-500:]  # what completes the upload
UPLOADING = request_bytes(
    "POST",
    "/v1/chat/completions",
    {"Authorization": f"Bearer {KEYS['normal']}", "Content-Type": "application/json"},
    _BODY,
)[: -len(UPLOAD_REST)]


# The uploads that fill the cap are one tenant's: its bound on bodies coming in (a quarter of the
# cap by default, tests/adversarial/served/test_uploads_served.py) raised so that they can.
ONE_TENANT_FILLS = {"max_uploads_per_tenant": CAP}


async def fill_the_cap(proxy: ServedProxy) -> Crowd:
    """``CAP`` connections with an upload in progress each, counted by the proxy: /metrics says
    so (the admin's own connection included). A proxy whose admin listener shares the cap
    cannot say so: then give it a moment, and the test's own checks tell."""
    held = await crowd(proxy.host, proxy.port, CAP, payload=UPLOADING)
    if proxy.admin_port is not None:
        # Until the proxy counts them all: not for 3 s, after which a busy host's proxy that
        # had not yet accepted every upload let the test go on below the cap.
        async def all_counted() -> bool:
            return await open_connections(proxy) >= CAP + 1

        await polls_until(all_counted, 600, f"the proxy to count {CAP} uploads")
        return held
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        with contextlib.suppress(ClosedEarly, OSError, AssertionError):
            if await open_connections(proxy) >= CAP + 1:
                break
        await asyncio.sleep(0.05)
    return held


async def test_every_connection_over_the_cap_gets_503_json_and_the_log_stays_short(
    start_served: StartServed,
) -> None:
    proxy = start_served(server={"max_connections": CAP}, input=ONE_TENANT_FILLS)
    held = await fill_the_cap(proxy)
    mark = proxy.mark()
    flood = await crowd(proxy.host, proxy.port, 100, payload=request_bytes("GET", "/v1/models"))
    try:
        answers = await flood.answers(timeout_s=10)
    finally:
        flood.close()
        held.close()
    refused = [a for a in answers if a is not None and a.status == 503]
    assert len(refused) == 100, [a.status if a else None for a in answers]
    for answer in refused:
        assert is_openai_error(answer) and answer.error_code() == "too_many_connections"
        assert answer.headers["retry-after"] == "1"
    # The held uploads, closed, each log their access line (499 client_gone): not refusals.
    new = [line for line in proxy.lines_since(mark) if "outcome=client_gone" not in line]
    assert proxy.tracebacks(mark) == 0, "\n".join(new[:40])
    # One line for the first refusal; the others fall in the same ten seconds.
    assert sum("refused" in line for line in new) == 1, "\n".join(new)
    assert len(new) <= 3, "\n".join(new)


async def test_the_admin_listener_answers_metrics_and_drain_through_a_flood(
    start_served: StartServed, backend: NullBackend
) -> None:
    proxy = start_served(server={"max_connections": CAP}, input=ONE_TENANT_FILLS)
    held = await fill_the_cap(proxy)
    try:
        over = await exchange(proxy.host, proxy.port, request_bytes("GET", "/v1/models"))
        assert over.status == 503  # the public listener is full
        assert await open_connections(proxy) >= CAP
        body = orjson.dumps({"url": backend.url, "drain": True})
        headers = {**ADMIN, "Content-Type": "application/json"}
        drain = request_bytes("POST", "/admin/backends/drain", headers, body)
        resp = await exchange(proxy.host, proxy.admin_port or 0, drain)
        assert resp.status == 200, resp.body[:300]
        assert orjson.loads(resp.body)["draining"] is True
    finally:
        held.close()


async def test_a_refused_client_that_already_sent_its_request_still_reads_the_503(
    start_served: StartServed,
) -> None:
    """A request sent in the same instant as the connect: the proxy drops it unread and must
    not answer the close with a RST that destroys the 503 before the client reads it."""
    proxy = start_served(server={"max_connections": CAP}, input=ONE_TENANT_FILLS)
    held = await fill_the_cap(proxy)
    try:
        for _ in range(20):
            client = await RawClient.connect(proxy.host, proxy.port)
            try:
                big = request_bytes("POST", "/v1/chat/completions", {}, b"x" * 3000)
                await client.send(big)
                await asyncio.sleep(0.05)  # the refusal is written and its FIN sent meanwhile
                resp = await client.read_response(timeout_s=5)
            finally:
                client.close()
            assert resp.status == 503 and resp.error_code() == "too_many_connections"
    finally:
        held.close()


# -- at the cap, the oldest connection still waiting for its first head is evicted (issue 22 #10)

HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
CHAT = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def test_one_client_holding_every_slot_with_half_heads_locks_nobody_out(
    start_served: StartServed,
) -> None:
    proxy = start_served(server={"max_connections": CAP, "header_timeout_s": 10})
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

    # The attacker holds a quarter more than the cap (the probe: 110 on 100), each re-opened at
    # once when closed (evicted or timed out).
    attackers = [asyncio.create_task(reopen()) for _ in range(CAP // 4)]
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
        told = sum(1 for a in evicted if a is not None and a.error_code() == "too_many_connections")
        # (one left unevicted meanwhile meets its header timeout)
        assert "too_many_connections" in codes, codes
        assert codes <= {"too_many_connections", "header_timeout"}, codes
    finally:
        stop.set()
        held.close()
        for task in attackers:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)
    assert proxy.tracebacks(mark) == 0
    assert proxy.count(r"connection\(s\) evicted", mark) >= 1
    # Counted too (round 3): every eviction the held clients were told of, and the attackers'.
    assert await metric(proxy, "tierproxy_connections_evicted_total") >= told >= 1


async def test_requests_in_progress_are_never_evicted(start_served: StartServed) -> None:
    proxy = start_served(server={"max_connections": CAP}, input=ONE_TENANT_FILLS)
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
