"""The KV memory that requests in flight hold on each backend, for ``backends: kv_aware``.

Room in request slots is not room in KV memory: three turns of 5,000-token conversations take
three slots of eight and 470 blocks of a 234-block cache, and vLLM preempts (and later
recomputes whole) whichever it admitted last. A request in flight holds its prompt's blocks
and the blocks of the answer it may write (``max_tokens``) until it ends; requests under one
prefix share its blocks, so each backend counts the distinct prompt blocks in flight there once.
What a request needs past a backend's cache beside what is in flight there is its overflow
(the cache: vLLM's ``num_gpu_blocks``, as its ``cache_config_info`` says; unknown: none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Flight:
    url: str
    blocks: tuple[int, ...]
    extra: int  # the blocks it holds past its prompt's full ones: a partial one, its answer


class KvInFlight:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._flights: dict[Hashable, _Flight] = {}
        self._blocks: dict[str, Counter[int]] = {}  # url -> prompt block -> flights holding it
        self._extra: Counter[str] = Counter()  # url -> blocks held past the prompts' full ones

    def extra_blocks(self, output_tokens: int) -> int:
        """The blocks a request holds past its prompt's full blocks: its last, partial one,
        and those its answer fills."""
        return 1 + -(-max(0, output_tokens) // self.block_size)

    def sent(self, key: Hashable, url: str, blocks: Sequence[int], output_tokens: int) -> None:
        self.ended(key)  # sent again (a retry): counted where it went last
        flight = _Flight(url, tuple(blocks), self.extra_blocks(output_tokens))
        self._flights[key] = flight
        self._blocks.setdefault(url, Counter()).update(flight.blocks)
        self._extra[url] += flight.extra

    def ended(self, key: Hashable) -> None:
        flight = self._flights.pop(key, None)
        if flight is None:
            return
        # .get: a flight of no blocks shares its backend's counter, which the end of another
        # flight there may have dropped once empty (a KeyError here was a 500 and a lost slot).
        held = self._blocks.get(flight.url)
        if held is not None:
            held.subtract(flight.blocks)
            for block in flight.blocks:
                if held[block] <= 0:
                    del held[block]
            if not held:
                del self._blocks[flight.url]
        self._extra[flight.url] -= flight.extra
        if self._extra[flight.url] <= 0:
            del self._extra[flight.url]

    def held(self, url: str) -> int:
        """The blocks the requests in flight on ``url`` hold (or will, once admitted)."""
        return len(self._blocks.get(url, ())) + self._extra.get(url, 0)

    def adds(self, url: str, blocks: Sequence[int], output_tokens: int) -> int:
        """The blocks a request of prompt ``blocks`` would add to what ``url`` holds."""
        held = self._blocks.get(url)
        new = len(blocks) if not held else sum(1 for b in blocks if b not in held)
        return new + self.extra_blocks(output_tokens)

    def overflow(
        self, url: str, blocks: Sequence[int], output_tokens: int, capacity: float | None
    ) -> float:
        """The blocks past ``url``'s cache that the request would need beside what is in
        flight there (0: it fits, the cache size is unknown, or nothing else is in flight)."""
        if capacity is None or url not in self._extra:
            return 0.0
        return max(0.0, self.held(url) + self.adds(url, blocks, output_tokens) - capacity)

    def excess(
        self,
        urls: Iterable[str],
        blocks: Sequence[int],
        output_tokens: int,
        capacities: Mapping[str, float],
    ) -> tuple[dict[str, float], float]:
        """Per backend of ``urls``, the tokens of KV memory the request would need past its
        cache beside what is in flight there (``overflow``), less the least any of them would
        (0s left out); and that least (0: one of them would take it now)."""
        over = {
            url: self.block_size * self.overflow(url, blocks, output_tokens, capacities.get(url))
            for url in urls
        }
        least = min(over.values(), default=0.0)
        return {url: o - least for url, o in over.items() if o > least}, least
