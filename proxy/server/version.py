"""vLLM's ``GET /version`` answered from a cache: the route is unauthenticated (as in vLLM), so
a scanner's flood must not become a flood of calls to every backend. One fetch at a time (the
callers meanwhile wait for the same one), its answer kept ``ttl_s``, a miss (no backend
answered) kept ``miss_ttl_s``: at most one fetch per period, whatever the request rate."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from proxy.backends.pool import BackendPool
from proxy.config.backends import BackendHealth

# A backend's version changes only with a restart; a stale answer for a minute is harmless.
VERSION_TTL_S = 60.0
# No backend answered: ask again soon, but not once per request.
MISS_TTL_S = 2.0


async def fetch_version(
    pool: BackendPool,
    clock: Callable[[], float],
    health: Callable[[], BackendHealth],
    session: Callable[[], aiohttp.ClientSession],
) -> str | None:
    """The version the first available backend reports, each call bounded by the probe
    timeout; None when none answers."""
    now, timeout_s = clock(), health().probe_timeout_s
    for backend in pool.all():
        if not backend.available(now):
            continue
        try:
            async with asyncio.timeout(timeout_s):
                async with session().get(backend.cfg.url + "/version") as resp:
                    body = await resp.content.read(4096)
                    if resp.status == 200:
                        return str(orjson.loads(body).get("version"))
        except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError):
            continue
        except AttributeError:  # not an object
            continue
    return None


class VersionCache:
    def __init__(
        self,
        fetch: Callable[[], Awaitable[str | None]],
        clock: Callable[[], float],
        *,
        ttl_s: float = VERSION_TTL_S,
        miss_ttl_s: float = MISS_TTL_S,
    ) -> None:
        self.fetch = fetch  # bounded in time itself (each backend's call has a timeout)
        self.clock = clock
        self.ttl_s = ttl_s
        self.miss_ttl_s = miss_ttl_s
        self._value: str | None = None
        self._expires = float("-inf")
        self._pending: asyncio.Task[str | None] | None = None
        self.fetches = 0

    async def get(self) -> str | None:
        if self.clock() < self._expires:
            return self._value
        if self._pending is None:
            # Owned here until it ends (``_settle``); a caller that leaves does not cancel it.
            self._pending = asyncio.get_running_loop().create_task(self._refresh())
        return await asyncio.shield(self._pending)

    async def stop(self) -> None:
        """At shutdown: a fetch still running is cancelled and awaited."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending

    async def _refresh(self) -> str | None:
        self.fetches += 1
        try:
            value = await self.fetch()
        except Exception:
            value = None
        self._value = value
        self._expires = self.clock() + (self.ttl_s if value is not None else self.miss_ttl_s)
        self._pending = None
        return value
