"""What the queue tells the policies about a tenant's backlog, and the heap they keep it in."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from proxy.policies.types import QueuedRequest


@dataclass(slots=True)
class TenantBacklog:
    """One tenant's queued requests in one tier, as the policies see them."""

    depth: int
    weight: float  # tenant weight carried by its newest request
    oldest: QueuedRequest  # the one that has waited longest (earliest arrival)
    since: int  # sequence number of the push that made the tenant backlogged in this tier


class BacklogObserver(Protocol):
    def backlog_changed(self, tier: str, tenant: str, backlog: TenantBacklog | None) -> None:
        """A tenant's backlog in a tier changed; None: it has nothing queued there any more."""


# A stale entry is left in the heap; past this many per live name, the heap is rebuilt.
_SLACK = 2


class KeyedHeap:
    """Names ordered by a key (a tuple) that changes: ``set`` pushes a fresh entry and makes
    the older one stale (lazy invalidation); stale entries are dropped when they surface, or all
    at once when they outnumber the live ones. O(log n) amortised per operation."""

    __slots__ = ("_heap", "_live", "_version")

    def __init__(self) -> None:
        self._heap: list[tuple[Any, ...]] = []  # (*key, version, name)
        self._live: dict[str, int] = {}  # name -> version of its one valid entry
        self._version = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, name: str) -> bool:
        return name in self._live

    def set(self, name: str, key: tuple[Any, ...]) -> None:
        version = next(self._version)
        self._live[name] = version
        heapq.heappush(self._heap, (*key, version, name))
        if len(self._heap) > _SLACK * len(self._live) + 64:
            self._compact()

    def discard(self, name: str) -> None:
        if self._live.pop(name, None) is not None and len(self._heap) > (
            _SLACK * len(self._live) + 64
        ):
            self._compact()

    def first(self, accept: Callable[[str], bool] | None = None) -> tuple[Any, ...] | None:
        """The entry (*key, version, name) with the smallest key among the names ``accept``
        allows."""
        heap, live = self._heap, self._live
        skipped: list[tuple[Any, ...]] = []
        found: tuple[Any, ...] | None = None
        while heap:
            entry = heap[0]
            name = entry[-1]
            if live.get(name) != entry[-2]:
                heapq.heappop(heap)
            elif accept is None or accept(name):
                found = entry
                break
            else:
                skipped.append(heapq.heappop(heap))
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def _compact(self) -> None:
        live = self._live
        self._heap = [e for e in self._heap if live.get(e[-1]) == e[-2]]
        heapq.heapify(self._heap)
