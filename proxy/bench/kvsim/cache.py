"""One engine's prefix cache as vLLM 0.32 keeps it (``vllm/v1/core/block_pool.py``,
``kv_cache_manager.py``): a pool of ``num_blocks`` blocks (block 0 is vLLM's null block, never
handed out), full blocks cached by their chained hash, a free queue from which new blocks are
taken at the front. A freed block without a hash goes to the front (taken first); a freed cached
block goes to the back, a request's blocks in reverse order (its tail is evicted before its
head), and stays cached until it is taken again (evicted, ``BlockRemoved``). A hit on a cached
block that is free takes it out of the free queue (``touch``).

A request holds a list of blocks: a hash (a cached block, shared by reference count) or None (a
block of its own, not full yet, or full but a duplicate of one cached already).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

Hook = Callable[[int], None]


def _ignore(block: int) -> None:
    pass


class PrefixCache:
    def __init__(
        self, num_blocks: int, on_stored: Hook = _ignore, on_removed: Hook = _ignore
    ) -> None:
        self.capacity = num_blocks - 1  # the null block is never handed out
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._refs: dict[int, int] = {}  # cached hash -> requests holding it
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # evicted from the front
        self._free_plain = self.capacity  # free blocks without a hash (taken first)
        self.evicted = 0

    @property
    def free(self) -> int:
        """Blocks a new allocation may take (plain ones, then cached ones no request holds)."""
        return self._free_plain + len(self._free_cached)

    @property
    def cached(self) -> int:
        return len(self._refs)

    def hit(self, hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks of ``hashes`` (at most ``max_blocks``) are cached."""
        n = 0
        for h in hashes[:max_blocks]:
            if h not in self._refs:
                break
            n += 1
        return n

    def allocate(self, held: list[int | None], hits: Sequence[int], new: int) -> bool:
        """Give a request ``hits`` (cached blocks it reuses, first allocation only) and ``new``
        more blocks, appended to ``held``; False (nothing changed) when the free queue cannot
        cover the new blocks and the free cached blocks the hits take out of it."""
        touched = sum(1 for h in hits if self._refs[h] == 0)
        if new + touched > self.free:
            return False
        for h in hits:
            if self._refs[h] == 0:
                del self._free_cached[h]
            self._refs[h] += 1
            held.append(h)
        for _ in range(new):
            if self._free_plain:
                self._free_plain -= 1
            else:
                gone, _ = self._free_cached.popitem(last=False)
                del self._refs[gone]
                self.evicted += 1
                self.on_removed(gone)
            held.append(None)
        return True

    def cache_block(self, held: list[int | None], index: int, block_hash: int) -> None:
        """The request's block ``index`` is full: cached under ``block_hash`` (a duplicate of a
        block cached already stays the request's own)."""
        if held[index] is not None or block_hash in self._refs:
            return
        held[index] = block_hash
        self._refs[block_hash] = 1
        self.on_stored(block_hash)

    def release(self, held: list[int | None]) -> None:
        """A request finished or was preempted: its blocks back to the free queue, tail first."""
        for h in reversed(held):
            if h is None:
                self._free_plain += 1
                continue
            self._refs[h] -= 1
            if self._refs[h] == 0:
                self._free_cached[h] = None
        held.clear()


class PooledLRU:
    """One LRU cache of ``capacity`` blocks standing for all the engines' caches together: what
    a placement that held nothing twice and moved nothing would hit (the family's reference for
    where the cache, not the placement, bounds the hits)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()  # evicted from the front

    def hit_then_note(self, blocks: Sequence[int], hashes: Sequence[int]) -> int:
        """How many of ``blocks`` (a prompt's, its head first) it holds as a prefix; then the
        prompt's ``hashes`` noted, the head last: as vLLM frees a request's blocks tail first,
        a chain is evicted from its end."""
        held = self._blocks
        known = 0
        while known < len(blocks) and blocks[known] in held:
            known += 1
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)
        return known
