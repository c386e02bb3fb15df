"""How many of something each tenant holds now, for the per-tenant bounds: tokenizer calls on
a backend (``max_cheap_inflight``'s share), bodies coming in (``input.max_uploads_per_tenant``),
long prompts on the tokenizer threads. A tenant holding none has no entry (a map of tenants,
not of every tenant ever seen)."""

from __future__ import annotations


class TenantCounts:
    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def of(self, tenant: str) -> int:
        return self.held.get(tenant, 0)

    def take(self, tenant: str, bound: int | None = None) -> bool:
        """One more for ``tenant``, unless it already holds ``bound``."""
        now = self.held.get(tenant, 0)
        if bound is not None and now >= bound:
            return False
        self.held[tenant] = now + 1
        return True

    def give_back(self, tenant: str) -> None:
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)
