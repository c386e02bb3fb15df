"""Backend room shared by the replicas that meter the same vLLM server.

Each replica holds a number of slots of each backend (``BackendState.granted``), taken from and
given back to Redis (``proxy.replicas.scripts``); its dispatcher never runs more there than it
holds. Slots are asked for when requests wait here and given back as soon as they are not
needed, with a message on a pub/sub channel that wakes every replica waiting for room (no poll
interval between a freed slot and its next use). Each replica renews a heartbeat; a replica
that stops (kill -9) loses its slots once the heartbeat is older than ``lease_ttl_s``, and a
replica waiting for room looks again exactly then.

A replica keeps up to an eighth of a backend's room as spare slots beyond what it needs, so that
a steady stream of requests does not pay a round trip each to take and give back a slot; the
first replica that finds too little room says so on the channel; for a lease TTL after that
every replica keeps no spare, and one holding more than its fair share (the room divided by the
live replicas) gives each slot its requests free back to Redis, not to its own queue, until it
is down to that share: a replica with a standing backlog cannot keep the others out.

Priority across replicas: ``priority_reserve`` slots past ``max_inflight`` that only a replica
with a best-tier request waiting may take (the plugin preempts lower tiers inside vLLM, so the
over-commit is safe and bounded). While Redis is down each replica meters alone (its own
``max_inflight``), and asks again from nothing when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from proxy.backends.backend import BackendState
from proxy.backends.pool import BackendPool
from proxy.replicas.client import SharedStateDown, SharedStore
from proxy.replicas.scripts import ROOM_ACQUIRE, ROOM_RELEASE
from proxy.tasks import OwnedTask

log = logging.getLogger("tierproxy.replicas")


class SharedBackendRoom:
    def __init__(
        self,
        store: SharedStore,
        pool: BackendPool,
        *,
        replica: str,
        waiting: Callable[[], int],
        best_tier_waiting: Callable[[], bool],
        kick: Callable[[], None],
    ) -> None:
        self.store = store
        self.pool = pool
        self.replica = replica
        self.waiting = waiting  # requests queued here
        self.best_tier_waiting = best_tier_waiting
        self.kick = kick  # the dispatcher: room was granted
        self.channel = store.key("backend-room-freed")
        self._wake = asyncio.Event()
        # The last look found less room than needed: the dispatcher's "no room" is no news
        # until a message, a local release or the retry time.
        self._short = False
        self._contended_until = 0.0  # another replica lacked room: keep no spare slots
        self._wanted_at = -1e9  # when we last said we lack room
        self._replicas: dict[str, int] = {}  # backend url -> live replicas metering it
        self._shed: dict[str, int] = {}  # backend url -> slots taken back, not yet in Redis
        self._loop = OwnedTask("tierproxy-shared-room")
        self._listener = OwnedTask("tierproxy-shared-room-messages")

    def start(self) -> None:
        self.pool.on_shared_room = self._changed
        self._loop.start(self._run)
        self._listener.start(self._listen)

    async def stop(self) -> None:
        await self._listener.stop()
        await self._loop.stop()
        self.pool.on_shared_room = None
        for state in self.pool.all():  # hand back what we hold, for the other replicas
            held = (state.granted or 0) + self._shed.pop(state.cfg.url, 0)
            state.granted = 0
            if held:
                with contextlib.suppress(SharedStateDown):
                    await self._give_back(state, held)
            state.granted = None

    def _changed(self, freed: bool) -> None:
        if freed:
            # Before the dispatcher reuses the slot (it runs right after this): over its fair
            # share while another replica lacks room, the slot goes back to Redis.
            if self._contended():
                self._shed_surplus()
            # Only when there is something to give back (a slot kept as spare costs nothing).
            if self._shed or self._holding_more():
                self._wake.set()
        elif not self._short:
            self._wake.set()

    def _holding_more(self, spare: bool = True) -> bool:
        """Some backend's granted slots exceed what this replica needs (and its spare)."""
        waiting = self.waiting()
        return any(
            (s.granted or 0) > s.inflight + waiting + (self._spare(s) if spare else 0)
            for s in self.pool.all()
        )

    def _keys(self, state: BackendState) -> list[str]:
        base = self.store.key("backend", "{" + state.cfg.url + "}")
        return [f"{base}:held", f"{base}:heartbeats"]

    # -- the loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        ttl = self.store.cfg.lease_ttl_s
        while True:
            self._wake.clear()
            timeout = ttl / 3  # the heartbeat's renewal
            self._short = False
            if self.store.up:
                for state in self.pool.all():
                    try:
                        timeout = min(timeout, await self.balance(state))
                    except SharedStateDown:
                        break
            if not self.store.up:
                self._shed.clear()
                for state in self.pool.all():
                    state.granted = None  # meter alone until Redis answers
                self.kick()
                timeout = self.store.cfg.probe_interval_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    async def balance(self, state: BackendState) -> float:
        """Ask for the slots this replica needs on ``state`` or give back the ones it does
        not; returns when to look again at the latest."""
        if state.granted is None:
            # First time, or Redis is back: whatever it still has of ours (a stall, a restart
            # from its append-only file) is overwritten by what we send now, 0.
            state.granted = 0
        shed = self._shed.pop(state.cfg.url, 0)
        if shed:
            await self._give_back(state, shed)
        cap = _room(state) + self.store.cfg.priority_reserve
        need = min(cap, state.inflight + self.waiting())
        spare = self._spare(state)
        if self._contended():
            # Up to the fair share only: the rest waits for what the others leave (next look).
            need = min(need, max(state.granted, self._fair(state)))
        if need > state.granted:
            better = self.best_tier_waiting()
            granted, retry_s, replicas = await self.store.run(
                ROOM_ACQUIRE,
                self._keys(state),
                [
                    self.replica,
                    self.store.cfg.lease_ttl_s,
                    min(cap, need + spare) - state.granted,
                    _room(state),
                    self.store.cfg.priority_reserve,
                    1 if better else 0,
                    state.granted,
                ],
            )
            self._replicas[state.cfg.url] = int(replicas)
            if int(granted):
                state.granted += int(granted)
                self.kick()
            if state.granted < need:
                self._short = True
                await self._say_wanted()
                return float(retry_s) + 0.01  # when a dead replica's slots come back
        elif need + spare < state.granted:
            await self._release(state, state.granted - need - spare)
        else:  # renew the heartbeat
            await self.store.run(
                ROOM_ACQUIRE,
                self._keys(state),
                [self.replica, self.store.cfg.lease_ttl_s, 0, 0, 0, 0, state.granted],
            )
        return self.store.cfg.lease_ttl_s / 3

    def _contended(self) -> bool:
        return time.monotonic() < self._contended_until

    def _spare(self, state: BackendState) -> int:
        return 0 if self._contended() else _room(state) // 8

    def _fair(self, state: BackendState) -> int:
        replicas = max(1, self._replicas.get(state.cfg.url, 1))
        return -(-_room(state) // replicas)

    def _shed_surplus(self) -> None:
        for state in self.pool.all():
            if state.granted is None:
                continue
            surplus = state.granted - max(state.inflight, self._fair(state))
            if surplus > 0:
                state.granted -= surplus
                url = state.cfg.url
                self._shed[url] = self._shed.get(url, 0) + surplus

    async def _say_wanted(self) -> None:
        """Tell the other replicas we lack room (once per heartbeat period at most)."""
        now = time.monotonic()
        if now - self._wanted_at < self.store.cfg.lease_ttl_s / 3:
            return
        self._wanted_at = now
        message = f"want {self.replica}"
        await self.store.call(lambda redis: redis.publish(self.channel, message))

    def _heard(self, data: object) -> None:
        text = data.decode() if isinstance(data, bytes) else str(data)
        if text.startswith("want "):
            if text == f"want {self.replica}":
                return
            self._contended_until = time.monotonic() + self.store.cfg.lease_ttl_s
            if not self._holding_more(spare=False):
                return
        self._wake.set()

    async def _release(self, state: BackendState, slots: int) -> None:
        assert state.granted is not None
        state.granted -= slots
        await self._give_back(state, slots)

    async def _give_back(self, state: BackendState, slots: int) -> None:
        """Give back ``slots`` (already taken off ``state.granted``): Redis's entry for this
        replica is set to what it now holds (what a lost call left there is overwritten)."""
        held = state.granted or 0
        await self.store.run(
            ROOM_RELEASE,
            self._keys(state),
            [self.replica, self.store.cfg.lease_ttl_s, slots, self.channel, state.cfg.url, held],
        )

    # -- messages ------------------------------------------------------------------------
    async def _listen(self) -> None:
        """Wake the loop whenever another replica frees room."""
        await self.store.listen(self.channel, self._heard, "room messages")


def _room(state: BackendState) -> int:
    """The backend's room as this replica sees it: ``max_inflight``, or what its controller
    learned from vLLM's own gauges (the same for every replica metering that vLLM)."""
    return max(1, int(state.max_room))
