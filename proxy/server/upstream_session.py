"""The one HTTP session to the backends, and its sockets.

A backend host that vanishes (an engine container killed: its address goes with it, and nothing
sends a reset) leaves a connection that neither fails nor answers. A request written into it
would wait out its tier's whole limit. Each upstream socket therefore carries TCP keep-alive
probes (a connection waiting for a long answer is probed) and TCP_USER_TIMEOUT (data or probes
unacknowledged this long close it): the request fails as a lost connection, which the pipeline
retries elsewhere when its client has been sent nothing. The kernel acknowledges for a busy
engine, so a slow answer is never cut by this, only a silent host.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import aiohttp

from proxy.config.backends import BackendHealth
from proxy.relay.upstreamio import head_sent_trace

# Keep-alive: the first probe after this share of the dead-connection time idle, then PROBES
# probes spread over the rest (Linux's own defaults, two hours idle, would never fire).
IDLE_SHARE = 0.5
PROBES = 3

SocketFactory = Callable[[tuple[Any, ...]], socket.socket]


def dead_peer_sockets(dead_after_s: float) -> SocketFactory:
    """aiohttp's ``socket_factory``: sockets that close within ``dead_after_s`` of their peer
    going silent."""
    idle = max(1, int(dead_after_s * IDLE_SHARE))
    interval = max(1, int((dead_after_s - idle) / PROBES))
    user_timeout_ms = int(dead_after_s * 1000)

    def make(addr_info: tuple[Any, ...]) -> socket.socket:
        family, kind, proto = addr_info[0], addr_info[1], addr_info[2]
        sock = socket.socket(family=family, type=kind, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        # Linux names; elsewhere the keep-alive stays at the system's own timing.
        for name, value in (
            ("TCP_KEEPIDLE", idle),
            ("TCP_KEEPINTVL", interval),
            ("TCP_KEEPCNT", PROBES),
            ("TCP_USER_TIMEOUT", user_timeout_ms),
        ):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
        return sock

    return make


def upstream_session(health: BackendHealth) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=health.connect_timeout_s),
        # Idle upstream connections close before uvicorn's 5 s keep-alive would close them under
        # us (a request written into a connection the server is closing fails for nothing).
        connector=aiohttp.TCPConnector(
            limit=0,
            keepalive_timeout=2.0,
            socket_factory=dead_peer_sockets(health.dead_connection_s),
        ),
        read_bufsize=2**20,
        # Answers are relayed as they come, never decoded: ask for them plain (aiohttp would
        # offer gzip, and a gzip-ing front's bytes reached clients labelled application/json).
        auto_decompress=False,
        headers={"Accept-Encoding": "identity"},
        trace_configs=[head_sent_trace()],  # a request its backend took, from one still connecting
    )
