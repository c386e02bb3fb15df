"""Opening a test's shared store: ``SharedStore.warm`` opens the pool's connections within its
own bound (1 s); a machine busy enough to pass it (an engine starting beside the test; three
tries once failed beside two 330 s fuzz runs) gets more tries rather than a failed fixture. The
proxy itself serves on when warm fails (``proxy.replicas.runtime``)."""

from __future__ import annotations

from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.replicas.client import SharedStore


async def warm(store: SharedStore, attempts: int = 8) -> None:
    for attempt in range(attempts):
        try:
            await store.warm()
            return
        except (TimeoutError, RedisTimeoutError):  # the pool's bound, or a connect's own
            if attempt == attempts - 1:
                raise
