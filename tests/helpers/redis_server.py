"""The real redis-server of the shared-state tests: ``proxy.bench.redis_server`` re-exported."""

from __future__ import annotations

from proxy.bench.redis_server import RedisServer

__all__ = ["RedisServer"]
