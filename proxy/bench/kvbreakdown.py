"""Where a conversation run's prefill went (``benchmarks/kv_routing.py``): each turn's reusable
part is the previous turn's prompt in whole blocks; what vLLM computed of it again was lost by
the turn moving to another engine, by eviction on its engine, or (a new conversation) by its
tenant's system prompt not being cached where it landed."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.bench.convclient import ChatRecord


@dataclass
class Breakdown:
    """Tokens, each a share of all the run's prompt tokens when divided by ``prompt``."""

    prompt: int = 0
    floor: int = 0  # each turn's new text, the flood, a tenant's first turn: no cache holds it
    moved: int = 0  # reusable, lost: the turn went to another engine than the previous one
    evicted: int = 0  # reusable, lost on the same engine
    new_conversation: int = 0  # a tenant's later conversation, its system prompt computed

    def shares(self) -> dict[str, float]:
        total = max(1, self.prompt)
        return {
            "floor": self.floor / total,
            "moved": self.moved / total,
            "evicted": self.evicted / total,
            "new_conversation": self.new_conversation / total,
        }


def breakdown(
    records: Sequence[ChatRecord], backend_of: Mapping[str, str], block_size: int
) -> Breakdown:
    """``backend_of``: request id -> the engine that served it (the usage log's ``backend``);
    a record without one (pinned runs) uses the url it was sent to."""
    out = Breakdown()
    turns: dict[str, list[ChatRecord]] = defaultdict(list)
    seen: set[str] = set()
    for rec in sorted(records, key=lambda r: r.sent):
        if rec.status != 200:
            continue
        out.prompt += rec.prompt_tokens
        computed = rec.prompt_tokens - (rec.cached_tokens or 0)
        if rec.kind != "turn":
            out.floor += computed
            continue
        history = turns[rec.conversation]
        prev = history[-1] if history else None
        history.append(rec)
        if rec.turn == 1 or prev is None:
            if rec.tenant in seen:
                out.new_conversation += computed
            else:
                out.floor += computed
            seen.add(rec.tenant)
            continue
        reusable = prev.prompt_tokens // block_size * block_size
        lost = max(0, reusable - (rec.cached_tokens or 0))
        out.floor += computed - lost
        engine = backend_of.get(rec.request_id, rec.url)
        if engine != backend_of.get(prev.request_id, prev.url):
            out.moved += lost
        else:
            out.evicted += lost
    return out
