"""A stall of the whole redis-server the shared-state tests run (``proxy.bench.redis_server``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from redis.asyncio import Redis
from redis.connection import Connection

from proxy.bench.redis_server import RedisServer


class Stall:
    """Redis stops answering anyone for ``seconds`` (as in a snapshot's fork or a slow fsync),
    then runs what it received meanwhile (``DEBUG SLEEP``; ``CLIENT PAUSE`` would not do: it
    drops the commands of a client that gives up and closes its connection).

    The command leaves on a blocking connection, written before the constructor returns: it is
    on Redis's socket before the test's next line runs. Sent from a task of the test's loop, it
    waited for that task's turn and its connection's handshake, and on a busy machine reached
    Redis after the requests it was meant to stall (CI, twice)."""

    def __init__(self, server: RedisServer, seconds: float) -> None:
        conn = Connection(host="127.0.0.1", port=server.port, socket_timeout=30.0)  # type: ignore[no-untyped-call]
        self._conn = conn
        conn.send_command("DEBUG", "SLEEP", seconds)  # type: ignore[no-untyped-call]

    async def over(self) -> None:
        """Returns once Redis has answered the sleep: it runs again."""
        assert await asyncio.to_thread(self._conn.read_response) in (b"OK", "OK")

    def close(self) -> None:
        self._conn.disconnect()  # type: ignore[no-untyped-call]


@contextmanager
def stalled(server: RedisServer, seconds: float) -> Iterator[Stall]:
    stall = Stall(server, seconds)
    try:
        yield stall
    finally:
        stall.close()


async def until_stalled(url: str, patience_s: float = 0.1, tries: int = 100) -> None:
    """Returns once Redis has stopped answering: a PING on a connection of its own goes without
    an answer for ``patience_s`` (the proof that the stall began, not a wait for it)."""
    probe = Redis.from_url(url)
    try:
        for _ in range(tries):
            try:
                await asyncio.wait_for(probe.ping(), patience_s)
            except TimeoutError:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"Redis still answered after {tries} pings")
    finally:
        await probe.aclose(close_connection_pool=True)
