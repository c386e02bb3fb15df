"""Shared prompt prefixes and where their new branches go, for ``backends: kv_aware``.

A block is a branch point once prompts went on past it with two different next blocks: a
tenant's system prompt under two conversations. The end of one conversation's turn is not one:
each later turn of that conversation goes on past it the same way. Each branch point has a
home, the backend its new branches (a tenant's new conversations) start on: the backend that
held the prefix when it became a branch point, moved only by the balance rule (``rehome``), so
that a tenant's conversations stay together on one backend whichever of them ran last.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

V = TypeVar("V")


class PrefixGroups:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._child: OrderedDict[int, int] = OrderedDict()  # block -> first next block seen
        self._home: OrderedDict[int, str] = OrderedDict()  # branch point -> its home backend

    def home(self, block: int) -> str | None:
        """The home of ``block`` if it is a branch point; None otherwise."""
        return self._home.get(block)

    def note(self, blocks: Sequence[int], known: int, holder: str | None) -> None:
        """A prompt of ``blocks`` was sent, of which the first ``known`` were sent before, the
        deepest of them last to ``holder``."""
        if not 0 < known < len(blocks) or holder is None:
            return
        point, child = blocks[known - 1], blocks[known]
        first = self._child.get(point)
        if first is None:
            _put(self._child, point, child, self.capacity)
        elif first != child and point not in self._home:
            _put(self._home, point, holder, self.capacity)

    def rehome(self, block: int, url: str) -> None:
        if block in self._home:
            _put(self._home, block, url, self.capacity)


def _put(d: OrderedDict[int, V], key: int, value: V, capacity: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > capacity:
        d.popitem(last=False)
