"""A backend as ``backends: kv_aware`` sees it, with a cache index that holds a set of block
hashes: for benchmarks and tests of the chooser alone, without engines or a pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.config.backends import Backend
from proxy.policies.types import ScrapedLoad


@dataclass(eq=False)
class IndexedBackend:
    """A BackendView whose index holds ``cached`` (chained block hashes); None: cold."""

    cfg: Backend
    inflight: int = 0
    room_cap: float = 8.0
    cached: set[int] | None = field(default_factory=set)
    reinstated_at: float | None = None

    @property
    def max_room(self) -> float:
        return self.room_cap

    def available(self, now: float) -> bool:
        return True

    def fresh_load(self, now: float, stale_after_s: float) -> ScrapedLoad | None:
        return None

    def cached_blocks(self, blocks: Sequence[int]) -> int | None:
        if self.cached is None:
            return None
        run = 0
        for b in blocks:
            if b not in self.cached:
                break
            run += 1
        return run
