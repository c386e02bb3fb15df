"""A client that stops reading a buffered (non-stream) answer, in process: the answer is written
under the send-idle timeout, the connection cut, the request logged 499 ``client_stalled``
and its bytes given back to the memory budget (issue 22). The served twin is in
tests/adversarial/served/test_served_held.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, running_proxy, until
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, relay_config, rig

ANSWER_BYTES = 900 * 1024  # held whole (under buffer_response_bytes), too big for loopback


def big_completion() -> bytes:
    message = {"role": "assistant", "content": "z" * ANSWER_BYTES}
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    return orjson.dumps(
        {"object": "chat.completion", "choices": [{"message": message}], "usage": usage}
    )


async def big_answer(request: web.Request, n: int) -> web.StreamResponse:
    return web.Response(body=big_completion(), content_type="application/json")


def realistic_socket() -> socket.socket:
    """A client as on a real network: MSS 1,400 and a 4 KiB receive window (set before
    connect), so the kernel cannot swallow a large answer on the client's behalf."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    return sock


@contextlib.asynccontextmanager
async def non_reader(host: str, port: int) -> AsyncIterator[socket.socket]:
    loop = asyncio.get_running_loop()
    sock = realistic_socket()
    payload = orjson.dumps(BODY)
    head = "".join(f"{k}: {v}\r\n" for k, v in auth("normal").items())
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n{head}"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    try:
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, request)
        yield sock
    finally:
        sock.close()


async def test_a_non_reader_of_a_held_answer_is_cut_and_its_bytes_released(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tierproxy.access")
    backend = FakeVLLM(script=big_answer)
    config = relay_config("x", send_idle_timeout_s=0.5, buffer_response_bytes=2 * 1024 * 1024)
    async with backend.serve() as url:
        config["backends"] = [{"url": url}]
        async with rig(config, clock) as r, non_reader(str(r.client.host), r.client.port or 0):
            await until(lambda: len(backend.received) == 1, 5, "the request at the backend")
            await until(lambda: r.requests_total("client_stalled") == 1, 4, "the cut")
            assert r.state.budget.held == 0
    assert "status=499 outcome=client_stalled" in caplog.text


async def test_a_reader_of_a_held_answer_gets_it_whole(clock: FakeClock) -> None:
    backend = FakeVLLM(script=big_answer)
    config = relay_config("x", send_idle_timeout_s=0.5, buffer_response_bytes=2 * 1024 * 1024)
    async with backend.serve() as url:
        config["backends"] = [{"url": url}]
        async with rig(config, clock) as r:
            resp = await r.chat()
            assert resp.status == 200
            assert await resp.read() == big_completion()
            assert r.state.budget.held == 0
            assert r.requests_total("ok") == 1


async def plain_404(request: web.Request, n: int) -> web.StreamResponse:
    return web.Response(status=404, text="404: Not Found")


async def test_a_held_answer_whose_body_a_prepare_hook_replaces_arrives_whole() -> None:
    """The app's hook rewrites a backend's plain-text error into OpenAI JSON while the answer
    is prepared: the held answer's slices are the new body, as long as its Content-Length."""
    backend = FakeVLLM(script=plain_404)
    async with (
        backend.serve() as url,
        running_proxy(relay_config(url)) as (base, _),
        aiohttp.ClientSession() as session,
        session.post(base + "/v1/chat/completions", json=BODY, headers=auth("normal")) as resp,
    ):
        body = await resp.json()
        assert resp.status == 404
        assert body["error"]["message"] == "404: Not Found"
