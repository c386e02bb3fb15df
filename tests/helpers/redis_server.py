"""The real redis-server of the shared-state tests: ``proxy.bench.redis_server`` re-exported,
and a stall of the whole server."""

from __future__ import annotations

from redis.asyncio import Redis

from proxy.bench.redis_server import RedisServer

__all__ = ["RedisServer", "stall"]


async def stall(redis: Redis, seconds: float) -> None:
    """Redis stops answering anyone for ``seconds`` (as in a snapshot's fork or a slow fsync),
    then runs what it received meanwhile. (``CLIENT PAUSE`` would not do: it drops the commands
    of a client that gives up and closes its connection.)"""
    await redis.execute_command("DEBUG", "SLEEP", seconds)  # type: ignore[no-untyped-call]
