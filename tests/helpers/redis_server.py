"""A stall of the whole redis-server the shared-state tests run (``proxy.bench.redis_server``)."""

from __future__ import annotations

from redis.asyncio import Redis


async def stall(redis: Redis, seconds: float) -> None:
    """Redis stops answering anyone for ``seconds`` (as in a snapshot's fork or a slow fsync),
    then runs what it received meanwhile. (``CLIENT PAUSE`` would not do: it drops the commands
    of a client that gives up and closes its connection.)"""
    await redis.execute_command("DEBUG", "SLEEP", seconds)  # type: ignore[no-untyped-call]
