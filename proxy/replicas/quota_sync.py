"""A recent copy of every configured tenant's shared quota counters, kept by each replica for
``on_failure: local``: a replica decides without Redis from the counters it last read, and
before this it had read only those of the tenants it had served since it started. A tenant
the balancer never sent to it (or any tenant, on a replica just started) was started at zero
during an outage: a fresh period's quota (red team, stop 58: 5,610 tokens counted on a limit of
3,000 after a 6 s stall)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from redis.asyncio import Redis

from proxy.api.quota_counters import COUNTERS
from proxy.replicas.client import SharedStateDown, SharedStore
from proxy.scheduling.quotas import QuotaLedger, period

log = logging.getLogger("tierproxy.replicas")

SYNC_S = 5.0  # how often the copy is read
# Keys read in one pipelined call: a call is bounded by call_timeout_s, and timeouts in a row
# mark Redis down for every tenant, so a large tenants file is read in slices.
KEYS_A_CALL = 256


class QuotaSync:
    def __init__(
        self,
        store: SharedStore,
        local: QuotaLedger,
        key: Callable[[str, str, str], str],
        owed: Callable[[str, str, str], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``key``: a counter's Redis key (tenant, counter, period); ``owed``: what this
        replica charged on it that Redis has not yet taken (kept on top of Redis's value)."""
        self.store = store
        self.local = local
        self.key = key
        self.owed = owed
        self.wall = wall
        self._watched: dict[str, tuple[str, ...]] = {}  # tenant -> its quota counters
        self._task: asyncio.Task[None] | None = None

    def watch(self, counters: Mapping[str, Iterable[str]]) -> None:
        """The tenants with quotas and their counters (at start and on every reload)."""
        self._watched = {t: tuple(cs) for t, cs in counters.items() if cs}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            if self.store.up and self._watched:
                try:
                    await self.sync()
                except SharedStateDown:
                    pass  # Redis away: the copy stays as last read
                except Exception:  # one odd answer must not end the copying for good
                    log.exception("reading the shared quota counters failed")
            await asyncio.sleep(SYNC_S)

    async def sync(self) -> None:
        """Read every watched counter's current period from Redis into the local ledger."""
        wall = self.wall()
        wanted = [
            (tenant, counter, period(COUNTERS[counter].span, wall)[0])
            for tenant, counters in self._watched.items()
            for counter in counters
        ]
        if not wanted:
            return

        for start in range(0, len(wanted), KEYS_A_CALL):
            await self._read(wanted[start : start + KEYS_A_CALL])

    async def _read(self, wanted: list[tuple[str, str, str]]) -> None:
        async def read(redis: Redis) -> list[object]:
            # One GET a key in a pipeline: a Redis Cluster splits it by slot (an MGET may not).
            pipe = redis.pipeline(transaction=False)
            for tenant, counter, name in wanted:
                pipe.get(self.key(tenant, counter, name))
            return list(await pipe.execute())

        values = await self.store.call(read)
        for (tenant, counter, name), value in zip(wanted, values, strict=True):
            number = _number(value)
            if number is not None:
                self.local.put(tenant, counter, name, number + self.owed(tenant, counter, name))


def _number(value: object) -> float | None:
    """A counter's value as the scripts read it (absent: 0); None for one they would not."""
    if value is None:
        return 0.0
    text = value.decode() if isinstance(value, bytes) else str(value)
    if text != text.strip():
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    return number if number == number and abs(number) != float("inf") else None
