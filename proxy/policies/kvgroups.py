"""Shared prompt prefixes and where their new branches go, for ``backends: kv_aware``.

A block is a branch point once prompts went on past it with two different next blocks: a
tenant's system prompt under two conversations. The end of one conversation's turn is not one:
each later turn of that conversation goes on past it the same way. Each branch point has a
home, the backend its new branches (a tenant's new conversations) start on: the backend that
held the prefix when it became a branch point, moved only by the balance rule (``rehome``), so
that a tenant's conversations stay together on one backend whichever of them ran last.

Learned only from requests that ran (``note``, called when one ended having run), in a room
shared between tenants, max-min fair (``TenantLru``): one tenant sending many distinct prompts
evicts its own branch points first, never those of a tenant keeping no more than its share
(red team: with one LRU for all, a flood of another tenant's branches pushed out a tenant's
system prompt's home, and its new conversations followed wherever a turn had run last).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from proxy.policies.kvlargest import Largest

V = TypeVar("V")


class PrefixGroups:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._child = TenantLru[int](capacity)  # block -> first next block seen
        self._home = TenantLru[str](capacity)  # branch point -> its home backend

    def home(self, block: int) -> str | None:
        """The home of ``block`` if it is a branch point; None otherwise."""
        return self._home.get(block)

    def branches(self, blocks: Sequence[int], run: int) -> bool:
        """Whether a prompt of ``blocks`` starts a new branch past its first ``run``: that block
        is a branch point, or a prompt that ran went on past it otherwise (a tenant's second
        conversation under its system prompt, before a third made it a branch point)."""
        if not 0 < run < len(blocks):
            return False
        point = blocks[run - 1]
        if self._home.get(point) is not None:
            return True
        first = self._child.get(point)
        return first is not None and first != blocks[run]

    def note(self, tenant: str, blocks: Sequence[int], known: int, holder: str | None) -> None:
        """A prompt of ``tenant``'s, of ``blocks``, ran; the first ``known`` were sent before,
        the deepest of them last to ``holder``."""
        if not 0 < known < len(blocks) or holder is None:
            return
        point, child = blocks[known - 1], blocks[known]
        first = self._child.get(point)
        if first is None:
            self._child.put(tenant, point, child)
            return
        self._child.touch(tenant, point)
        if first == child:
            return
        if self._home.get(point) is None:
            self._home.put(tenant, point, holder)
        else:
            self._home.touch(tenant, point)  # a branch point in use stays

    def rehome(self, block: int, url: str) -> None:
        """The balance rule moved ``block``'s home (at a send: undone if it did not run), in
        place: the move alone keeps no branch point longer."""
        self._home.set(block, url)

    def kept_by_tenant(self) -> dict[str, int]:
        """Each tenant's branch points kept (its share of the room)."""
        return self._home.kept_by_tenant()


class TenantLru(Generic[V]):
    """Values by key, each key kept by the tenants whose work put or used it, at most
    ``capacity`` (tenant, key) pairs in all. Past it, the tenant keeping the most loses its
    least recently used key (a key goes once no tenant keeps it): a tenant keeping no more
    than ``capacity / tenants`` never loses one to another. A share rather than a fixed room
    per tenant: the memory stays bounded however many tenants come, and one tenant alone may
    use all of it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._values: dict[Hashable, V] = {}
        self._refs: dict[Hashable, int] = {}  # key -> how many tenants keep it
        self._kept: dict[str, OrderedDict[Hashable, None]] = {}  # least recently used first
        self._size = 0
        self._largest = Largest()  # each tenant's kept keys: who loses one past the capacity

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: Hashable) -> V | None:
        return self._values.get(key)

    def put(self, tenant: str, key: Hashable, value: V) -> None:
        self._values[key] = value
        self._refs.setdefault(key, 0)
        self.touch(tenant, key)

    def touch(self, tenant: str, key: Hashable) -> None:
        """``tenant`` used ``key`` (if held): it keeps it, most recently used."""
        if key not in self._values:
            return
        kept = self._kept.setdefault(tenant, OrderedDict())
        if key in kept:
            kept.move_to_end(key)
            return
        kept[key] = None
        self._largest.add(tenant)
        self._refs[key] += 1
        self._size += 1
        while self._size > self.capacity:
            self._evict_one()

    def set(self, key: Hashable, value: V) -> None:
        """A held key's value changed; who keeps it does not."""
        if key in self._values:
            self._values[key] = value

    def kept_by_tenant(self) -> dict[str, int]:
        return {tenant: len(keys) for tenant, keys in self._kept.items()}

    def _evict_one(self) -> None:
        tenant = self._largest.largest()
        assert tenant is not None  # called only past the capacity: someone keeps a key
        kept = self._kept[tenant]
        key, _ = kept.popitem(last=False)
        self._largest.remove(tenant)
        if not kept:
            del self._kept[tenant]
        self._size -= 1
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key], self._values[key]
