"""What one engine holds in its prefix cache, as its KV events tell it: the proxy's chained
hash (``proxy.policies.blockhash``) of every block it stored and has not removed, bounded in
memory, with whether the index can be trusted (warm) or may miss blocks (cold).

vLLM's block hashes are not stable across its processes, so a block is keyed by the proxy's
own hash of its tokens, chained from its parent; vLLM's hash of each block maps to it so that
``BlockRemoved`` (which names only vLLM's hashes) finds it. The events come in sequence-numbered
batches (``proxy.backends.kvevents``): a batch lost (a gap, a reconnect) may hide removals, so
the index then drops everything. How far it is trusted (``Trust``): *exact* once it heard the
engine from its first batch (or a replay of it) or an ``AllBlocksCleared``; *partial* while it
only lacks the blocks stored before it joined the stream (a new connection) or before its last
gap: it never claims a block the engine removed, so it is trusted at once (after ``resync_s``,
0 by default); *cold* while no connection is up (nothing known).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from proxy.policies.blockhash import NO_PARENT, ExtraKeys, chain

VllmHash = Hashable  # vLLM's ExternalBlockHash: an int, or bytes


@dataclass
class IndexStats:
    stored: int = 0  # blocks stored (events' blocks, whether new or seen again)
    evicted: int = 0  # dropped for the memory bound
    orphans: int = 0  # stored blocks whose parent the index does not know: not indexed


class Trust(IntEnum):
    """How far a backend's index is trusted (``tierproxy_kv_index_trust``)."""

    COLD = 0  # no connection up (or within resync_s of a join or a gap): not used
    PARTIAL = 1  # lacks the blocks stored before it joined or before a gap; never over-predicts
    EXACT = 2  # holds every block the engine holds (up to max_blocks)


class KvIndex:
    def __init__(
        self, block_size: int, max_blocks: int, clock: Callable[[], float], resync_s: float = 0.0
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.clock = clock
        self.resync_s = resync_s
        # proxy hash -> vLLM hash, oldest stored first (the eviction order).
        self._blocks: OrderedDict[int, VllmHash] = OrderedDict()
        self._proxy_of: dict[VllmHash, int] = {}
        self._level = Trust.COLD
        self._warm_at = 0.0  # a partial index is used from then (resync_s after it began)
        self.stats = IndexStats()

    def __len__(self) -> int:
        return len(self._blocks)

    # -- state ---------------------------------------------------------------------------

    def trust(self, now: float | None = None) -> Trust:
        level = self._level
        if level == Trust.PARTIAL and (self.clock() if now is None else now) < self._warm_at:
            return Trust.COLD
        return level

    def warm(self, now: float | None = None) -> bool:
        """The chooser may use it: every block it holds, the engine holds (exact or partial)."""
        return self.trust(now) > Trust.COLD

    def synced_from_start(self) -> None:
        """The engine's first batch (sequence 0) arrived: nothing was missed, exact at once."""
        self.clear()
        self._level = Trust.EXACT

    def lost_sync(self) -> None:
        """A gap: what was missed may have removed blocks. Drop everything; from here it hears
        every batch again: partial (blocks stored before the gap stay unknown, and it may only
        under-predict), used after ``resync_s``."""
        self.clear()
        self._partial()

    def joined(self) -> None:
        """A connection to the engine's stream is up: a cold (empty) index is partial from here."""
        if self._level == Trust.COLD:
            self._partial()

    def dropped(self) -> None:
        """No connection (a new one opening, the old one dropped): cold, nothing known."""
        self.clear()
        self._level = Trust.COLD

    def all_cleared(self) -> None:
        """An ``AllBlocksCleared`` heard: the engine's cache is empty, so the index is exact."""
        self.clear()
        if self._level != Trust.COLD:
            self._level = Trust.EXACT

    def _partial(self) -> None:
        self._level = Trust.PARTIAL
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
