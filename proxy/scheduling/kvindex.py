"""What one engine holds in its prefix cache, as its KV events tell it: the proxy's chained
hash (``proxy.policies.blockhash``) of every block it stored and has not removed, bounded in
memory, with whether the index can be trusted (warm) or may miss blocks (cold).

vLLM's block hashes are not stable across its processes, so a block is keyed by the proxy's
own hash of its tokens, chained from its parent; vLLM's hash of each block maps to it so that
``BlockRemoved`` (which names only vLLM's hashes) finds it. The events come in sequence-numbered
batches (``proxy.scheduling.kvevents``): a batch lost (a gap, a reconnect) may hide removals, so
the index then drops everything and is cold until ``resync_s`` of gap-free events have passed
(a cold index only misses blocks: the engine holds what it stored since, and more).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from proxy.policies.blockhash import NO_PARENT, ExtraKeys, chain

VllmHash = Hashable  # vLLM's ExternalBlockHash: an int, or bytes


@dataclass
class IndexStats:
    stored: int = 0  # blocks stored (events' blocks, whether new or seen again)
    evicted: int = 0  # dropped for the memory bound
    orphans: int = 0  # stored blocks whose parent the index does not know: not indexed


class KvIndex:
    def __init__(
        self, block_size: int, max_blocks: int, clock: Callable[[], float], resync_s: float
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.clock = clock
        self.resync_s = resync_s
        # proxy hash -> vLLM hash, oldest stored first (the eviction order).
        self._blocks: OrderedDict[int, VllmHash] = OrderedDict()
        self._proxy_of: dict[VllmHash, int] = {}
        self._warm_at: float | None = None  # None: cold until synced from a known start
        self.stats = IndexStats()

    def __len__(self) -> int:
        return len(self._blocks)

    # -- state ---------------------------------------------------------------------------

    def warm(self, now: float | None = None) -> bool:
        """The index holds every block the engine holds (up to the memory bound)."""
        at = self._warm_at
        return at is not None and (self.clock() if now is None else now) >= at

    def synced_from_start(self) -> None:
        """The engine's first batch (sequence 0) arrived: nothing was missed, warm at once."""
        self.clear()
        self._warm_at = self.clock()

    def lost_sync(self) -> None:
        """A gap or a reconnect: what was missed may have removed blocks. Drop everything; warm
        again after ``resync_s`` (blocks stored before the gap stay unknown: the index may only
        under-predict meanwhile)."""
        self.clear()
        self._warm_at = self.clock() + self.resync_s

    def clear(self) -> None:
        self._blocks.clear()
        self._proxy_of.clear()

    # -- events --------------------------------------------------------------------------

    def store(
        self,
        vllm_hashes: Sequence[VllmHash],
        parent: VllmHash | None,
        token_ids: Sequence[int],
        extra_keys: Sequence[ExtraKeys] | None,
    ) -> None:
        """A ``BlockStored``: ``len(vllm_hashes)`` full blocks of ``token_ids`` after the block
        vLLM hashed ``parent`` (None: from the prompt's start)."""
        size = self.block_size
        if parent is None:
            chained = NO_PARENT
        else:
            known = self._proxy_of.get(parent)
            if known is None:  # its parent was evicted here or missed: the chain is broken
                self.stats.orphans += len(vllm_hashes)
                return
            chained = known
        hashes = chain(chained, token_ids[: len(vllm_hashes) * size], size, extra_keys)
        # A short token list (never from vLLM) indexes the blocks it covers only.
        for proxy_hash, vllm_hash in zip(hashes, vllm_hashes, strict=False):
            self._put(proxy_hash, vllm_hash)
        self.stats.stored += len(vllm_hashes)
        self._bound()

    def _put(self, proxy_hash: int, vllm_hash: VllmHash) -> None:
        old = self._blocks.get(proxy_hash)
        if old is not None and old != vllm_hash:
            self._proxy_of.pop(old, None)
        self._blocks[proxy_hash] = vllm_hash
        self._blocks.move_to_end(proxy_hash)
        self._proxy_of[vllm_hash] = proxy_hash

    def remove(self, vllm_hashes: Sequence[VllmHash]) -> None:
        for vllm_hash in vllm_hashes:
            proxy_hash = self._proxy_of.pop(vllm_hash, None)
            if proxy_hash is not None and self._blocks.get(proxy_hash) == vllm_hash:
                del self._blocks[proxy_hash]

    def _bound(self) -> None:
        # Oldest stored first: the engine's own LRU evicts those too, sooner or later.
        while len(self._blocks) > self.max_blocks:
            _, vllm_hash = self._blocks.popitem(last=False)
            self._proxy_of.pop(vllm_hash, None)
            self.stats.evicted += 1

    # -- lookups -------------------------------------------------------------------------

    def leading(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` (proxy hashes) the index holds."""
        held = self._blocks
        n = 0
        for proxy_hash in blocks:
            if proxy_hash not in held:
                break
            n += 1
        return n
