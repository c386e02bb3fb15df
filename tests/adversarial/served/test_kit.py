"""The kit itself, against the served proxy: a realistic client gets a whole answer, and the
served process is the one a user runs (uvloop, C parser)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from proxy.bench.hostile.kit import (
    MSS,
    RawClient,
    exchange,
    is_openai_error,
    json_request,
    request_bytes,
)
from proxy.bench.hostile.served import ServedProxy, StartServed, auth_header


async def test_a_realistic_client_gets_a_whole_answer(served: ServedProxy) -> None:
    body = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    req = json_request("/v1/chat/completions", body, None, {"Authorization": auth_header("high")})
    resp = await exchange(served.host, served.port, req)
    assert resp.status == 200, resp.body
    assert served.on_default_loop()


async def test_the_socket_options_hold_before_connect(served: ServedProxy) -> None:
    client = await RawClient.connect(served.host, served.port)
    try:
        assert client.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG) <= MSS
        # Linux doubles SO_RCVBUF for its bookkeeping; a 4 KiB ask stays far under 64 KiB.
        assert client.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) <= 16384
        await client.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await client.read_response()
        assert resp.status == 401 and is_openai_error(resp)
    finally:
        client.close()


async def test_a_slow_body_gets_408_json_within_the_knob(start_served: StartServed) -> None:
    proxy = start_served(input={"body_read_timeout_s": 0.5})
    body = b'{"model": "null", "messages": [{"role": "user", "content": "hi"}]}'
    headers = {
        "Authorization": auth_header("low"),
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
    }
    client = await RawClient.connect(proxy.host, proxy.port)
    try:
        await client.send(request_bytes("POST", "/v1/chat/completions", headers))
        sender = asyncio.create_task(client.send_slowly(body, chunk=1, gap_s=0.1))
        try:
            resp = await client.read_response(timeout_s=5)
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sender
    finally:
        client.close()
    assert resp.status == 408 and is_openai_error(resp), resp.body[:300]
    assert resp.error_code() == "body_timeout"
