"""Upstream sockets close within ``dead_connection_s`` of their peer going silent: the kernel
holds the keep-alive and user-timeout values the factory asked for (the behaviour itself, an
engine container killed mid-request, is driven in tests/compose)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.backends import BackendHealth
from proxy.server.upstream_session import PROBES, dead_peer_sockets, upstream_session


@pytest.mark.parametrize("dead_after_s", [2.0, 10.0, 45.0])
def test_upstream_sockets_give_up_on_a_silent_peer_within_the_setting(dead_after_s: float) -> None:
    make = dead_peer_sockets(dead_after_s)
    addr = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 1))
    with make(addr) as sock:
        opt = sock.getsockopt
        assert opt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle = opt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        interval = opt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        assert opt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == PROBES
        # An idle connection sends its first probes within the setting, and one with data or
        # probes unacknowledged that long is closed.
        assert idle >= 1 and idle + interval <= dead_after_s
        assert opt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(dead_after_s * 1000)


async def test_the_upstream_sessions_connections_carry_them() -> None:
    answered = asyncio.Event()

    async def ok(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        await out.prepare(request)  # the head now, the end once the client has looked
        await out.write(b"o")
        await answered.wait()
        await out.write_eof(b"k")
        return out

    app = web.Application()
    app.router.add_get("/", ok)
    session = upstream_session(BackendHealth(dead_connection_s=6.0))
    try:
        async with TestServer(app) as server, session.get(server.make_url("/")) as resp:
            assert resp.connection is not None and resp.connection.transport is not None
            sock = resp.connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 6000
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            answered.set()
            assert await resp.read() == b"ok"
    finally:
        await session.close()


def test_a_dead_connection_time_below_two_seconds_is_refused() -> None:
    with pytest.raises(ValueError, match="dead_connection_s"):
        BackendHealth(dead_connection_s=0.5)
