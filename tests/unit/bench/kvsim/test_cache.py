"""The simulator's prefix cache (proxy.bench.kvsim.cache): vLLM 0.32's block pool, hand-checked."""

from __future__ import annotations

from proxy.bench.kvsim.cache import PooledLRU, PrefixCache


def _cache(blocks: int) -> tuple[PrefixCache, list[int], list[int]]:
    stored: list[int] = []
    removed: list[int] = []
    return PrefixCache(blocks, stored.append, removed.append), stored, removed


def test_the_null_block_is_never_handed_out_and_a_full_pool_refuses() -> None:
    cache, _, _ = _cache(4)
    held: list[int | None] = []
    assert cache.free == 3
    assert not cache.allocate(held, (), 4)
    assert held == [] and cache.free == 3  # nothing changed
    assert cache.allocate(held, (), 3) and cache.free == 0


def test_full_blocks_are_cached_and_hit_while_held_or_free() -> None:
    cache, stored, _ = _cache(8)
    a: list[int | None] = []
    cache.allocate(a, (), 3)
    cache.cache_block(a, 0, 11)
    cache.cache_block(a, 1, 12)  # the third block is not full: no hash
    assert stored == [11, 12] and cache.hit([11, 12, 13], 3) == 2
    assert cache.hit([11, 12], 1) == 1  # capped (vLLM recomputes the last token)
    cache.release(a)
    assert cache.free == 7 and cache.hit([11, 12], 2) == 2  # free, still cached
    b: list[int | None] = []
    assert cache.allocate(b, [11, 12], 1)
    assert b == [11, 12, None] and cache.free == 4  # the hits left the free queue


def test_a_duplicate_full_block_stays_private() -> None:
    cache, stored, _ = _cache(8)
    a: list[int | None] = []
    b: list[int | None] = []
    cache.allocate(a, (), 1)
    cache.allocate(b, (), 1)
    cache.cache_block(a, 0, 5)
    cache.cache_block(b, 0, 5)
    assert stored == [5] and b == [None]


def test_eviction_takes_plain_blocks_first_then_the_least_recently_freed_tail_first() -> None:
    cache, _, removed = _cache(6)  # 5 usable
    a: list[int | None] = []
    cache.allocate(a, (), 3)
    for i, h in enumerate((1, 2, 3)):
        cache.cache_block(a, i, h)
    b: list[int | None] = []
    cache.allocate(b, (), 2)
    cache.cache_block(b, 0, 7)  # b's second block stays plain
    cache.release(a)  # freed tail first: 3, 2, 1 join the queue in that order
    cache.release(b)  # its plain block goes to the front, 7 to the back
    c: list[int | None] = []
    assert cache.allocate(c, (), 1) and removed == []  # the plain block first
    assert cache.allocate(c, (), 2) and removed == [3, 2]  # then a's tail, then its middle
    assert cache.hit([1], 1) == 1 and cache.hit([7], 1) == 1
    assert cache.allocate(c, (), 2) and removed == [3, 2, 1, 7]
    assert cache.evicted == 4


def test_a_hit_on_a_free_block_counts_against_the_free_queue() -> None:
    cache, _, _ = _cache(4)  # 3 usable
    a: list[int | None] = []
    cache.allocate(a, (), 2)
    cache.cache_block(a, 0, 1)
    cache.cache_block(a, 1, 2)
    cache.release(a)
    b: list[int | None] = []
    # 2 touched free blocks + 2 new > 3 free: refused, nothing taken
    assert not cache.allocate(b, [1, 2], 2) and cache.free == 3
    assert cache.allocate(b, [1, 2], 1) and cache.free == 0


def test_the_pooled_reference_hits_a_prefix_and_evicts_a_chain_from_its_tail() -> None:
    pooled = PooledLRU(3)
    assert pooled.hit_then_note([1, 2], [1, 2, 3]) == 0  # cold
    assert pooled.hit_then_note([1, 2, 9], [1, 2, 9]) == 2  # a prefix, then a miss
    # Four distinct blocks noted into three: the first chain's tail (3) went, its head stayed.
    assert pooled.hit_then_note([1, 2, 3], [1, 2, 3]) == 2
    # Another chain of three takes the whole room: the older one goes, its head last.
    assert pooled.hit_then_note([5, 6, 7], [5, 6, 7]) == 0
    assert pooled.hit_then_note([1], [1]) == 0 and pooled.hit_then_note([5, 6], [5, 6]) == 2
