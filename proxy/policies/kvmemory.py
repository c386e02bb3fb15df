"""Where ``backends: kv_aware`` sent prompts' blocks: what only real work may shape.

A prompt's blocks are *in flight* from the moment the chooser sends them (``sent``) until the
request ends (``ended``). Meanwhile their deepest block's backend is the prompt's home, and for
``pending_s`` they count as cached there (the engine's KV events lag its prefill). When the
request ends having run, its blocks are *kept*: each block's last backend stays its home until
the memory's room runs out, and each (backend, block) counts as cached until ``pending_s``
after it was sent only where the backend's index is cold (``pending_run(kept=True)``): a warm
index has heard the events of a request that ran, and of the evictions since. When it ends
without running (the engine refused it with a 4xx, the connection failed, its handler left
before it was sent) its flight is dropped and nothing of it stays: a flood of prompts the
engine never ran erases no placement.

The room (``capacity`` kept (backend, block) pairs) is shared between tenants, max-min fair:
past it, the tenant keeping the most loses its least recently sent pair. A tenant keeping
no more than ``capacity / tenants`` never loses one to another: a flooding tenant evicts its own
placement first. A share, rather than a weight by work done: work done (tokens computed) is
known only at the end and favours long prompts, whereas a share bounds what any one tenant can
take from another whatever it sends, with no estimate in it. Tenants of one cache group share
blocks: a block kept on several backends stays home on the newest other when the last one's
pair goes (one tenant's flood evicting its own pair took the other tenant's home with it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from proxy.policies.kvlargest import Largest

Pair = tuple[str, int]  # (backend url, chained block hash)


@dataclass(frozen=True, slots=True)
class Flight:
    tenant: str
    url: str
    blocks: tuple[int, ...]
    at: float  # when it was sent (the memory's clock)


class PlacementMemory:
    def __init__(self, capacity: int, pending_s: float, clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.pending_s = pending_s
        self.clock = clock
        self._flights: dict[Hashable, Flight] = {}  # request -> its blocks in flight
        # Block -> (backend, when sent, tenant) of each flight holding it, the newest last.
        self._flying: dict[int, list[tuple[str, float, str]]] = {}
        # Each tenant's kept pairs, least recently sent first.
        self._kept: dict[str, OrderedDict[Pair, None]] = {}
        self._refs: dict[Pair, int] = {}  # kept pair -> how many tenants keep it
        self._sent_at: dict[Pair, float] = {}  # kept pair -> when it was last sent
        self._owner: dict[int, str] = {}  # kept block -> the backend it was last sent to
        # kept block -> every backend a tenant keeps it on (tenants of one cache group share
        # blocks): when the owner's last pair goes, the block's home falls to the newest other
        self._keepers: dict[int, set[str]] = {}
        self._size = 0  # pairs kept, all tenants together
        self._largest = Largest()  # each tenant's kept pairs: who loses one past the room
        self._by_backend: dict[str, Counter[str]] = {}  # tenant -> its kept pairs per backend

    # -- the request path's seam -----------------------------------------------------------

    def sent(self, key: Hashable, tenant: str, url: str, blocks: Sequence[int]) -> None:
        """The request ``key``'s prompt ``blocks`` were sent to ``url``: in flight there."""
        self.ended(key, ran=False)  # a flight not ended (never expected): replaced
        flight = Flight(tenant, url, tuple(blocks), self.clock())
        self._flights[key] = flight
        for block in flight.blocks:
            self._flying.setdefault(block, []).append((url, flight.at, tenant))

    def ended(self, key: Hashable, *, ran: bool) -> Flight | None:
        """The request ``key`` ended; ``ran``: the engine worked on it (else no trace stays).
        Its flight if it had one and ran, kept now; None otherwise."""
        flight = self._flights.pop(key, None)
        if flight is None:
            return None
        for block in flight.blocks:
            urls = self._flying[block]
            urls.remove((flight.url, flight.at, flight.tenant))
            if not urls:
                del self._flying[block]
        if not ran:
            return None
        self._keep(flight)
        return flight

    # -- what the chooser reads ------------------------------------------------------------

    def pending_run(self, url: str, blocks: Sequence[int], *, kept: bool = True) -> int:
        """How many leading ``blocks`` were sent to ``url`` within ``pending_s``, in flight or
        (``kept``) kept (block hashes are chained: a block sent means every one before it was
        too)."""
        horizon = self.clock() - self.pending_s
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            if any(u == url and at >= horizon for u, at, _ in self._flying.get(block, ())):
                return i + 1
            at = self._sent_at.get((url, block)) if kept else None
            if at is not None and at >= horizon:
                return i + 1
        return 0

    def home(self, blocks: Sequence[int], tenant: str | None = None) -> tuple[str | None, int]:
        """The backend the deepest of ``blocks`` ever sent was last sent to, and how many
        leading blocks that is (None, 0: none was sent). Where ``tenant`` itself sent that
        block, where it last did: tenants of a cache group share a preamble's blocks, and
        another's send of it elsewhere (a first conversation started apart) does not move this
        tenant's home."""
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            own = self._own_home(tenant, block) if tenant is not None else None
            if own is not None:
                return own, i + 1
            flying = self._flying.get(block)
            if flying:
                return flying[-1][0], i + 1
            owner = self._owner.get(block)
            if owner is not None:
                return owner, i + 1
        return None, 0

    def sent_by(self, tenant: str, block: int) -> bool:
        """Whether ``tenant`` itself sent ``block`` (in flight, or kept): else only other
        tenants of its cache group did (a preamble they share)."""
        return self._own_home(tenant, block) is not None

    def _own_home(self, tenant: str, block: int) -> str | None:
        """Where ``tenant`` last sent ``block``: its newest flight, else the backend it keeps it
        on sent last; None: it never sent it, or its pair went."""
        for url, _, t in reversed(self._flying.get(block, ())):
            if t == tenant:
                return url
        kept = self._kept.get(tenant)
        if not kept:
            return None
        urls = [u for u in self._keepers.get(block, ()) if (u, block) in kept]
        return max(urls, key=lambda u: self._sent_at[(u, block)]) if urls else None

    def kept_by_tenant(self) -> dict[str, int]:
        """Each tenant's kept pairs: its placement the chooser remembers."""
        return {tenant: len(pairs) for tenant, pairs in self._kept.items() if pairs}

    def placement(self) -> dict[str, dict[str, int]]:
        """Each tenant's kept pairs per backend (/admin/status): where it lives."""
        return {t: dict(c) for t, c in self._by_backend.items() if t in self._kept}

    def in_flight(self) -> int:
        return len(self._flights)

    # -- keeping ---------------------------------------------------------------------------

    def _keep(self, flight: Flight) -> None:
        kept = self._kept.setdefault(flight.tenant, OrderedDict())
        for block in flight.blocks:
            pair = (flight.url, block)
            if pair in kept:
                kept.move_to_end(pair)
            else:
                kept[pair] = None
                self._largest.add(flight.tenant)
                self._refs[pair] = self._refs.get(pair, 0) + 1
                self._keepers.setdefault(block, set()).add(flight.url)
                self._size += 1
                self._by_backend.setdefault(flight.tenant, Counter())[flight.url] += 1
            self._sent_at[pair] = max(flight.at, self._sent_at.get(pair, flight.at))
            self._owner[block] = flight.url
        while self._size > self.capacity:
            self._evict_one()

    def _evict_one(self) -> None:
        """The least recently sent pair of the tenant keeping the most."""
        tenant = self._largest.largest()
        assert tenant is not None  # called only past the capacity: someone keeps a pair
        kept = self._kept[tenant]
        (url, block), _ = kept.popitem(last=False)
        self._largest.remove(tenant)
        counts = self._by_backend[tenant]
        counts[url] -= 1
        if not counts[url]:
            del counts[url]
        if not kept:
            del self._kept[tenant], self._by_backend[tenant]
        self._size -= 1
        pair = (url, block)
        self._refs[pair] -= 1
        if self._refs[pair] == 0:
            del self._refs[pair], self._sent_at[pair]
            keepers = self._keepers[block]
            keepers.discard(url)
            if not keepers:
                del self._keepers[block]
            if self._owner.get(block) == url:
                # Another tenant of its cache group may keep the block elsewhere: its home.
                if keepers:
                    self._owner[block] = max(keepers, key=lambda u: self._sent_at[(u, block)])
                else:
                    del self._owner[block]
