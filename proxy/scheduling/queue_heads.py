"""Which models the queue's next requests are for: each tenant's head in each tier, the only
request of that tenant the dequeue order can pick next. The adapter slot rules read it to keep
an idle adapter that a waiting request is about to use (``proxy.backends.adapter_rules``): a
model wanted only deeper in some tenant's queue cannot be picked before that tenant's head, so
it is not counted. Pure bookkeeping, O(1) per change."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection


class HeadModels:
    def __init__(self) -> None:
        self._head: dict[tuple[str, str], str] = {}  # (tier, tenant) -> its head's model
        self._tiers: dict[str, Counter[str]] = {}  # model -> tier -> heads for it

    def set(self, tier: str, tenant: str, model: str | None) -> None:
        """``tenant``'s head in ``tier`` is now for ``model`` (None: no head, or no model)."""
        key = (tier, tenant)
        old = self._head.get(key)
        if old == model:
            return
        if old is not None:
            counts = self._tiers[old]
            counts[tier] -= 1
            if counts[tier] <= 0:
                del counts[tier]
                if not counts:
                    del self._tiers[old]
            del self._head[key]
        if model is not None:
            self._head[key] = model
            self._tiers.setdefault(model, Counter())[tier] += 1

    def tiers_wanting(self, model: str) -> Collection[str]:
        """The tiers in which some tenant's next request is for ``model``."""
        counts = self._tiers.get(model)
        return counts.keys() if counts else ()
