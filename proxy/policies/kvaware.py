"""``backends: kv_aware``: the backend where the request's prompt is already cached, weighed
against how busy it is, from each backend's index of vLLM's own KV-cache events.

A backend's score for a request is the share of its prompt it would not have to prefill there
(the longest cached prefix in tokens, ``cached_blocks * block_size``, over the prompt) plus the
tier's latency weight times the share of the backend's room left after taking it (in-flight
work and vLLM's own queue, as ``least_utilised`` sees them). A better tier weighs room more: a
high-tier request goes to an idle backend rather than queue behind a hot cache; a low-tier
batch request follows its cache onto a busier backend. Scores that tie (every index cold, or
no prefix cached anywhere) fall back to a balanced choice: the most room left, then the
longest cached prefix, then the backend chosen longest ago (never config order).

Between a dispatch and the KV events of its prefill, the index does not yet show the prompt: a
burst of one conversation's turns, or of one tenant's system prompt, would scatter. So the
chooser remembers for ``pending_s`` where it sent each prompt's blocks and counts them as
cached there meanwhile.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from proxy.policies.backends import TIE, B, Candidate, Rotation, free_share, slot_room
from proxy.policies.types import BackendView, QueuedRequest

if TYPE_CHECKING:
    from proxy.config.backends import BackendHealth


class KvAware:
    def __init__(
        self,
        *,
        block_size: int,
        latency_weights: Mapping[str, float],
        pending_s: float = 10.0,
        pending_blocks: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.latency_weights = dict(latency_weights)  # tier -> weight of room against cache
        self.pending_s = pending_s
        self.pending_blocks = pending_blocks
        self.clock = clock
        self._rotation = Rotation()
        # (backend url, chained block hash) -> when it was sent there; oldest first.
        self._pending: OrderedDict[tuple[str, int], float] = OrderedDict()
        # Chained block hash -> the backend it was last sent to (least recently sent first).
        self._owner: OrderedDict[int, str] = OrderedDict()

    def room(self, state: BackendView, now: float, health: BackendHealth) -> float:
        return slot_room(state, now, health)

    def cached_tokens(self, state: BackendView, blocks: Sequence[int]) -> int:
        """The longest prefix of ``blocks`` cached on ``state`` or sent there lately, in tokens
        (0: none, or the index is cold)."""
        if not blocks:
            return 0
        indexed = state.cached_blocks(blocks) or 0
        return max(indexed, self._pending_run(state.cfg.url, blocks)) * self.block_size

    def pick(self, candidates: Sequence[Candidate[B]], request: QueuedRequest | None) -> B | None:
        blocks = request.prompt_blocks if request is not None else None
        weight = self.latency_weights.get(request.tier, 1.0) if request is not None else 1.0
        prompt = max(1, request.prompt_tokens) if request is not None else 1
        if blocks:  # the prompt's real length: its full blocks and a partial one
            prompt = (len(blocks) + 1) * self.block_size
        self._expire()
        best: B | None = None
        best_key = (0, 0, 0, 0, 0)
        for c in candidates:
            saved = self.cached_tokens(c.state, blocks) if blocks else 0
            room = free_share(c)
            score = min(1.0, saved / prompt) + weight * room
            # Last among ties: where the prompt's prefix was last sent, so that a tenant's new
            # conversations gather where its system prompt is (each backend holding every
            # tenant's would halve what both caches hold); then the least recently chosen.
            owned = self._owned_run(c.state.cfg.url, blocks) if blocks else 0
            age = self._rotation.age(c.state)
            key = (round(score / TIE), round(room / TIE), saved, owned, age)
            if best is None or key > best_key:
                best, best_key = c.state, key
        return best

    def served(self, state: BackendView, request: QueuedRequest | None) -> None:
        self._rotation.chose(state)
        blocks = request.prompt_blocks if request is not None else None
        if not blocks:
            return
        now, url = self.clock(), state.cfg.url
        for block in blocks:
            key = (url, block)
            self._pending[key] = now
            self._pending.move_to_end(key)
            self._owner[block] = url
            self._owner.move_to_end(block)
        while len(self._pending) > self.pending_blocks:
            self._pending.popitem(last=False)
        while len(self._owner) > self.pending_blocks:
            self._owner.popitem(last=False)

    def _pending_run(self, url: str, blocks: Sequence[int]) -> int:
        # Block hashes are chained: a block sent means every block before it was sent too.
        for i in range(len(blocks) - 1, -1, -1):
            if (url, blocks[i]) in self._pending:
                return i + 1
        return 0

    def _owned_run(self, url: str, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` whose deepest was last sent to ``url``."""
        for i in range(len(blocks) - 1, -1, -1):
            owner = self._owner.get(blocks[i])
            if owner is not None:
                return i + 1 if owner == url else 0
        return 0

    def _expire(self) -> None:
        horizon = self.clock() - self.pending_s
        while self._pending:
            key, at = next(iter(self._pending.items()))
            if at >= horizon:
                break
            del self._pending[key]


def latency_weights(priorities: Mapping[str, int], best: float, worst: float) -> dict[str, float]:
    """Each tier's weight of room against cache, from ``best`` (the best priority) to
    ``worst`` (the worst), geometrically between; one priority alone gets ``best``."""
    ranks = sorted(set(priorities.values()))
    span = len(ranks) - 1
    return {
        tier: best * (worst / best) ** (ranks.index(p) / span) if span else best
        for tier, p in priorities.items()
    }
