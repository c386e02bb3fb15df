"""A stall of the whole redis-server the shared-state tests run (``proxy.bench.redis_server``)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis


async def stall(redis: Redis, seconds: float) -> None:
    """Redis stops answering anyone for ``seconds`` (as in a snapshot's fork or a slow fsync),
    then runs what it received meanwhile. (``CLIENT PAUSE`` would not do: it drops the commands
    of a client that gives up and closes its connection.)"""
    await redis.execute_command("DEBUG", "SLEEP", seconds)  # type: ignore[no-untyped-call]


async def until_stalled(url: str, patience_s: float = 0.1, tries: int = 100) -> None:
    """Returns once Redis has stopped answering: a PING on a connection of its own goes without
    an answer for ``patience_s``. A test that starts its stall and then merely sleeps races the
    command's way to Redis on a busy machine (CI once saw every request served before it)."""
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
