"""Hostile clients on raw sockets, as an attacker (or a phone on a bad link) would be.

Every socket gets a realistic MSS (``TCP_MAXSEG`` 1,400) and a small receive window
(``SO_RCVBUF`` 4 KiB) before it connects: over loopback's 64 KiB MSS the kernel swallows about
1 MiB of an answer a client never reads, so a non-reader looks like a reader. Everything is
asyncio on non-blocking sockets (the test's loop stays free) and every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import orjson

MSS = 1400  # a typical Internet path's segment (1,500 MTU less IP and TCP headers)
RCVBUF = 4096  # a receive window a slow or hostile client keeps small
TIMEOUT_S = 10.0


def realistic_socket(*, mss: int = MSS, rcvbuf: int = RCVBUF) -> socket.socket:
    """A non-blocking TCP socket with its MSS and receive buffer set (before connect: the
    window scale and MSS are fixed in the handshake)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


def request_bytes(
    method: str,
    path: str,
    headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    content_length: bool = True,
) -> bytes:
    """An HTTP/1.1 request, byte for byte (no normalising: hostile input stays hostile)."""
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    names = {name.lower() for name, _ in pairs}
    if "host" not in names:
        pairs.insert(0, ("Host", "proxy"))
    if content_length and body and "content-length" not in names:
        pairs.append(("Content-Length", str(len(body))))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in pairs)
    return head.encode("latin-1") + b"\r\n" + body


def json_request(
    path: str, body: object, key: str | None, extra: Mapping[str, str] | None = None
) -> bytes:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    headers.update(extra or {})
    return request_bytes("POST", path, headers, orjson.dumps(body))


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names; a repeated name keeps its last value
    body: bytes
    raw_head: bytes = b""

    def json(self) -> object:
        return orjson.loads(self.body)

    def error_code(self) -> str | None:
        """The OpenAI error's ``code`` (None when the body is not an OpenAI error)."""
        try:
            data = self.json()
        except orjson.JSONDecodeError:
            return None
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            code = data["error"].get("code")
            return str(code) if code is not None else None
        return None


def is_openai_error(resp: Response) -> bool:
    """``{"error": {"message", "type", "param", "code"}}`` with a JSON content type."""
    if "application/json" not in resp.headers.get("content-type", ""):
        return False
    try:
        data = resp.json()
    except orjson.JSONDecodeError:
        return False
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return False
    err = data["error"]
    return {"message", "type", "param", "code"} <= err.keys() and isinstance(err["message"], str)


class ClosedEarly(ConnectionError):
    """The server closed before a whole response arrived (``partial``: what did)."""

    def __init__(self, partial: bytes) -> None:
        super().__init__(f"closed after {len(partial)} bytes: {partial[:200]!r}")
        self.partial = partial


@dataclass
class RawClient:
    """One connection. Reads only when asked: between reads it is a non-reader."""

    sock: socket.socket
    buffer: bytearray = field(default_factory=bytearray)
    eof: bool = False

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        mss: int = MSS,
        rcvbuf: int = RCVBUF,
        timeout_s: float = TIMEOUT_S,
    ) -> RawClient:
        sock = realistic_socket(mss=mss, rcvbuf=rcvbuf)
        try:
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout_s)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def send(self, data: bytes, timeout_s: float = TIMEOUT_S) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_sendall(self.sock, data), timeout_s)

    async def send_slowly(
        self, data: bytes, *, chunk: int = 1, gap_s: float = 0.05, timeout_s: float = TIMEOUT_S
    ) -> None:
        """``data`` in ``chunk``-byte pieces, ``gap_s`` apart (a slow body or slowloris)."""
        for start in range(0, len(data), chunk):
            await self.send(data[start : start + chunk], timeout_s)
            if start + chunk < len(data):
                await asyncio.sleep(gap_s)

    async def _fill(self, deadline: float) -> bool:
        """Read what arrives before ``deadline``; False at EOF."""
        if self.eof:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete response in time")
        loop = asyncio.get_running_loop()
        try:
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), left)
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    async def read_response(self, timeout_s: float = TIMEOUT_S) -> Response:
        """One whole response (Content-Length, chunked, or until close)."""
        deadline = time.monotonic() + timeout_s
        while b"\r\n\r\n" not in self.buffer:
            if not await self._fill(deadline):
                raise ClosedEarly(bytes(self.buffer))
        end = self.buffer.index(b"\r\n\r\n")
        raw_head = bytes(self.buffer[:end])
        del self.buffer[: end + 4]
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            body = await self._exactly(int(headers["content-length"]), deadline, raw_head)
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._chunked(deadline, raw_head)
        elif status in (204, 304) or 100 <= status < 200:
            body = b""
        else:
            while await self._fill(deadline):
                pass
            body = bytes(self.buffer)
            self.buffer.clear()
        return Response(status, headers, body, raw_head)

    async def _exactly(self, n: int, deadline: float, head: bytes) -> bytes:
        while len(self.buffer) < n:
            if not await self._fill(deadline):
                raise ClosedEarly(head + b"\r\n\r\n" + bytes(self.buffer))
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def _line(self, deadline: float, head: bytes) -> bytes:
        while b"\r\n" not in self.buffer:
            if not await self._fill(deadline):
                raise ClosedEarly(head + bytes(self.buffer))
        end = self.buffer.index(b"\r\n")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    async def _chunked(self, deadline: float, head: bytes) -> bytes:
        body = bytearray()
        while True:
            size = int((await self._line(deadline, head)).split(b";")[0], 16)
            if size == 0:
                while await self._line(deadline, head):  # trailers, then the empty line
                    pass
                return bytes(body)
            body += await self._exactly(size, deadline, head)
            await self._line(deadline, head)

    async def read_until(self, marker: bytes, count: int, timeout_s: float = TIMEOUT_S) -> int:
        """Read (head and body as they come) until ``marker`` was seen ``count`` times or the
        server closed; how many times it was seen. Then the client may vanish mid-answer."""
        deadline = time.monotonic() + timeout_s
        while self.buffer.count(marker) < count and await self._fill(deadline):
            pass
        return self.buffer.count(marker)

    async def closed_by_peer(self, timeout_s: float = TIMEOUT_S) -> bool:
        """Drain until the server closes (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(TimeoutError):
            while await self._fill(deadline):
                pass
            return True
        return False

    def close(self) -> None:
        self.sock.close()

    def abort(self) -> None:
        """Close with a RST (SO_LINGER 0), as a client that vanishes does."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
        self.sock.close()


async def exchange(host: str, port: int, request: bytes, timeout_s: float = TIMEOUT_S) -> Response:
    """One request on a fresh realistic connection, its whole response, then close (a server
    that answers before the request is all sent, and closes, is read all the same)."""
    client = await RawClient.connect(host, port, timeout_s=timeout_s)
    try:
        # A server that answered early (431, 503) and closed: read what it said.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await client.send(request, timeout_s)
        return await client.read_response(timeout_s)
    finally:
        client.close()


# -- hostile patterns ---------------------------------------------------------------------------
def unfinished_headers(field_bytes: int = 8000, fields: int = 127) -> bytes:
    """A request line and ``fields`` header fields of ``field_bytes`` each, never the blank line
    that ends them: the parser keeps all of it while it waits (each field under aiohttp's
    8,190-byte line limit, their count under its 128-field limit)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
    value = b"a" * max(1, field_bytes - 12)
    return head + b"".join(b"X-Pad-%03d: %s\r\n" % (i, value) for i in range(fields))


@dataclass
class Crowd:
    """Many open connections held by one test; ``close()`` closes them all."""

    clients: list[RawClient] = field(default_factory=list)
    failed: int = 0  # connects refused or timed out

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.clients.clear()

    async def answers(self, timeout_s: float = TIMEOUT_S) -> list[Response | None]:
        """Each client's response (None where it closed or timed out without one)."""

        async def one(client: RawClient) -> Response | None:
            try:
                return await client.read_response(timeout_s)
            except (ClosedEarly, TimeoutError, OSError):
                return None

        return list(await asyncio.gather(*(one(c) for c in self.clients)))


async def crowd(
    host: str,
    port: int,
    n: int,
    *,
    payload: bytes = b"",
    parallel: int = 64,
    timeout_s: float = TIMEOUT_S,
) -> Crowd:
    """``n`` connections, each sending ``payload`` (nothing: idle) and then reading nothing;
    ``parallel`` connects at a time. A flood past the cap, partial headers, non-readers."""
    held = Crowd()
    gate = asyncio.Semaphore(parallel)

    async def one() -> None:
        async with gate:
            try:
                client = await RawClient.connect(host, port, timeout_s=timeout_s)
            except (OSError, TimeoutError):
                held.failed += 1
                return
            held.clients.append(client)
            if payload:
                with contextlib.suppress(OSError, TimeoutError):
                    await client.send(payload, timeout_s)

    try:
        await asyncio.gather(*(one() for _ in range(n)))
    except BaseException:
        held.close()
        raise
    return held


async def non_reader(host: str, port: int, request: bytes) -> RawClient:
    """A client that sends ``request`` and then never reads (a stream or a buffered answer):
    with a 4 KiB window the server's writes stall after a few segments."""
    client = await RawClient.connect(host, port)
    try:
        await client.send(request)
    except BaseException:
        client.close()
        raise
    return client
