"""Opening a test's shared store: ``SharedStore.warm`` opens the pool's connections within its
own bound (1 s); a machine busy enough to pass it once (an engine starting beside the test)
gets another try rather than a failed fixture. The proxy itself serves on when warm fails
(``proxy.shared.runtime``)."""

from __future__ import annotations

from proxy.shared.client import SharedStore


async def warm(store: SharedStore, attempts: int = 3) -> None:
    for attempt in range(attempts):
        try:
            await store.warm()
            return
        except TimeoutError:
            if attempt == attempts - 1:
                raise
