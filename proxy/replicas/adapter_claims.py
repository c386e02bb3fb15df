"""LoRA adapter slots shared by the replicas that send to the same vLLM engine: never more
distinct adapters in flight there, counted over all live replicas, than its ``max_loras``.

Each replica claims, per engine, the adapters it may run there (``AdapterSlots.claimed``) from
a Redis record (``ADAPTER_CLAIM`` in ``proxy.replicas.scripts``); its dispatcher starts a
request for an adapter there only when it holds the claim, else notes the adapter as wanted and
the request waits in its queue. All replicas' claims on an engine name at most ``max_loras``
distinct adapters; claiming one that another replica claims takes no new slot. The claims of
adapters in flight are kept, idle ones kept while nobody lacks a slot (a steady stream pays no
round trip per request) and given back at once, with a message, after another replica said it
lacks one (for a lease TTL). Each replica renews a heartbeat while it claims anything; a
replica that stops (kill -9) loses its claims once the heartbeat is older than
``lease_ttl_s``, and a replica waiting for a slot looks again exactly then.

While Redis is down (or before the first answer) each replica counts alone, as without shared
state (``claimed`` None: its own ``max_loras``), and claims again from what it runs when Redis
is back. The best tier's reserve and a tenant's share stay each replica's own view.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

from proxy.backends.backend import BackendState
from proxy.backends.pool import BackendPool
from proxy.replicas.client import SharedStateDown, SharedStore
from proxy.replicas.scripts import ADAPTER_CLAIM
from proxy.tasks import OwnedTask

log = logging.getLogger("tierproxy.replicas")


class SharedAdapterSlots:
    def __init__(
        self, store: SharedStore, pool: BackendPool, *, replica: str, kick: Callable[[], None]
    ) -> None:
        self.store = store
        self.pool = pool
        self.replica = replica
        self.kick = kick  # the dispatcher: a claim was granted
        self.channel = store.key("adapter-slots")
        self._wake = asyncio.Event()
        self._contended_until = 0.0  # another replica lacked a slot: keep no idle claim
        self._wanted_at = -1e9  # when we last said we lack a slot
        self._beat_at: dict[str, float] = {}  # backend url -> when its heartbeat is due
        self._replicas: dict[str, int] = {}  # backend url -> replicas claiming there
        # backend url -> (the wants refused at the last call, when to ask again at the latest)
        self._refused: dict[str, tuple[frozenset[str], float]] = {}
        self._loop = OwnedTask("tierproxy-adapter-claims")
        self._listener = OwnedTask("tierproxy-adapter-claims-messages")

    def start(self) -> None:
        self.pool.on_adapter_claims = self._wake.set
        self._loop.start(self._run)
        self._listener.start(self._listen)

    async def stop(self) -> None:
        await self._listener.stop()
        await self._loop.stop()
        self.pool.on_adapter_claims = None
        for state in self._states():  # hand back what we claim, for the other replicas
            if state.adapters.claimed:
                state.adapters.claimed = set()
                with contextlib.suppress(SharedStateDown):
                    await self._call(state, [], [], [], freed=True)
            state.adapters.claimed = None
            state.adapters.elsewhere = frozenset()

    def _states(self) -> list[BackendState]:
        return [s for s in self.pool.all() if s.cfg.max_loras is not None]

    def _keys(self, state: BackendState) -> list[str]:
        base = self.store.key("backend", "{" + state.cfg.url + "}")
        return [f"{base}:adapters", f"{base}:adapter-heartbeats"]

    def _contended(self) -> bool:
        return time.monotonic() < self._contended_until

    def _fair(self, state: BackendState) -> int:
        """The engine's slots divided among the replicas claiming there and the one that
        lacks a slot (at least two)."""
        replicas = max(2, self._replicas.get(state.cfg.url, 1))
        return -(-(state.cfg.max_loras or 1) // replicas)

    # -- the loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._wake.clear()
            timeout = self.store.cfg.lease_ttl_s / 3
            if self.store.up:
                for state in self._states():
                    try:
                        timeout = min(timeout, await self.balance(state))
                    except SharedStateDown:
                        break
            if not self.store.up:
                self._beat_at.clear()
                self._refused.clear()
                for state in self._states():  # count alone until Redis answers
                    state.adapters.claimed = None
                    state.adapters.elsewhere = frozenset()
                self.kick()
                timeout = self.store.cfg.probe_interval_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, timeout)):
                    await self._wake.wait()

    async def balance(self, state: BackendState) -> float:
        """Claim what this replica's requests wait for on ``state``, give back idle claims
        another replica may need, renew the heartbeat; returns when to look again at the
        latest."""
        slots = state.adapters
        url = state.cfg.url
        now = time.monotonic()
        first = slots.claimed is None
        claimed: set[str] = set() if slots.claimed is None else slots.claimed
        # In flight, or granted since the last dispatch pass (its request has not had a pass to
        # start in yet: given back now, two wanted adapters would take each other's slot for
        # ever, neither ever dispatched).
        keep = sorted(slots.running() | slots.loading | (slots.fresh & claimed))
        want = sorted(slots.wanted - claimed - set(keep))
        idle = sorted(claimed - set(keep))
        refused, retry_at = self._refused.get(url, (frozenset(), 0.0))
        if want and set(want) <= refused and now < retry_at:
            want = []  # nothing new since the refusal: wait for a message or the retry time
        if self._contended():
            # Another replica lacks a slot: claim no new one past the fair share (else a
            # replica with a standing backlog hands each slot it frees to itself), and give
            # back what runs nothing here.
            want = want[: max(0, self._fair(state) - len(keep))]
            idle = idle if want else []
        beat_at = self._beat_at.get(url, 0.0) if claimed else now + 3600.0
        sent = set(keep) | set(idle)
        if not (first or want or now >= beat_at or sent != claimed):
            return max(0.01, min(beat_at, retry_at if refused else beat_at) - now)
        # Until the answer only what runs here is surely ours, and the idle claims unless a
        # want may take their slot.
        slots.claimed = set(keep) if want else sent
        mine, others, retry_s, replicas = await self._call(
            state, keep, want, idle, freed=bool(claimed - sent)
        )
        slots.claimed = mine
        slots.elsewhere = frozenset(others)
        self._replicas[url] = replicas
        self._beat_at[url] = now + self.store.cfg.lease_ttl_s / 3
        if mine - claimed:
            slots.fresh |= mine - claimed
            self.kick()
        if set(want) - mine:  # refused: nothing frees before a message or a heartbeat expiry
            self._refused[url] = (frozenset(want), now + retry_s + 0.01)
            await self._say_wanted()
            return retry_s + 0.01
        self._refused.pop(url, None)
        return self.store.cfg.lease_ttl_s / 3

    async def _call(
        self, state: BackendState, keep: list[str], want: list[str], idle: list[str], *, freed: bool
    ) -> tuple[set[str], set[str], float, int]:
        ask = json.dumps({"keep": keep, "want": want, "idle": idle})
        mine, others, retry_s, replicas = await self.store.run(
            ADAPTER_CLAIM,
            self._keys(state),
            [
                self.replica,
                self.store.cfg.lease_ttl_s,
                state.cfg.max_loras,
                self.channel if freed else "",
                state.cfg.url,
                ask,
            ],
        )
        return set(json.loads(mine)), set(json.loads(others)), float(retry_s), int(replicas)

    async def _say_wanted(self) -> None:
        """Tell the other replicas we lack a slot (once per heartbeat period at most)."""
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
        else:  # "freed <url>": a refused want may fit now
            self._refused.pop(text.removeprefix("freed "), None)
        self._wake.set()

    # -- messages ------------------------------------------------------------------------
    async def _listen(self) -> None:
        """Wake the loop whenever another replica frees a slot or lacks one."""
        await self.store.listen(self.channel, self._heard, "adapter slot messages")
