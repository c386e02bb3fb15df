"""Per-tenant limits: requests per minute, tokens per minute, concurrent requests.

Token buckets on an injected clock rather than aiolimiter: the proxy must answer *how long*
to wait (an accurate ``Retry-After``), give back the unused part of a token reservation once
the real ``usage`` is known, and be tested over a simulated minute without sleeping; aiolimiter
exposes none of these (its level is private and it reads the event loop's clock).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from proxy.api.reply_headers import BucketWindow
from proxy.config.tenants import Tenant


class TokenBucket:
    """Holds up to ``capacity`` units, refilled continuously at ``rate_per_s``."""

    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._level = capacity
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._level = min(self.capacity, self._level + (now - self._at) * self.rate_per_s)
            self._at = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (0 when it can be now)."""
        self._refill(now)
        # The pipeline refuses a request bigger than the whole bucket before it gets here
        # (proxy.api.errors.over_token_limit); one that a reload made bigger waits for a full
        # bucket, then goes.
        need = min(amount, self.capacity) - self._level
        return max(0.0, need / self.rate_per_s)

    def take(self, amount: float, now: float) -> None:
        """Take ``amount``; the level may go below zero (an oversize request, usage past its
        estimate), as debt paid off by the refill, but never below ``-capacity``: one huge
        answer costs the tenant at most one minute of its limit, not hours of being refused."""
        self._refill(now)
        self._level = max(self._level - amount, -self.capacity)

    def window(self, now: float) -> BucketWindow:
        """Read-only: what the x-ratelimit-* headers report."""
        level = min(self.capacity, self._level + max(0.0, now - self._at) * self.rate_per_s)
        return BucketWindow(self.capacity, level, (self.capacity - level) / self.rate_per_s)

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self._level = min(self.capacity, self._level + amount)


@dataclass(frozen=True)
class LimitVerdict:
    allowed: bool
    retry_after_s: float = 0.0
    limit: str = ""  # which limit said no: requests_per_minute | tokens_per_minute | max_concurrent
    # The registry's own key for this admission, handed back to ``settle``: minted by the
    # registry, never a client's header (a reused X-Request-Id must not merge two admissions).
    hold: str = ""
    # Admitted: the tenant's windows just after it took its share (its stream's x-ratelimit-*).
    windows: Mapping[str, BucketWindow] = field(default_factory=dict)


class TenantLimiter:
    """The limits of one tenant. Decisions are all-or-nothing: a refused request takes nothing."""

    def __init__(self, tenant: Tenant, now: float) -> None:
        self.rpm: TokenBucket | None = None
        self.tpm: TokenBucket | None = None
        self.max_concurrent: int | None = None
        self.concurrent = 0
        self.update(tenant, now)

    def update(self, tenant: Tenant, now: float) -> None:
        """New limits from a reloaded config; the current levels carry over, clipped."""
        self.rpm = self._bucket(self.rpm, tenant.requests_per_minute, now)
        self.tpm = self._bucket(self.tpm, tenant.tokens_per_minute, now)
        self.max_concurrent = tenant.max_concurrent

    @staticmethod
    def _bucket(
        old: TokenBucket | None, per_minute: float | None, now: float
    ) -> TokenBucket | None:
        if per_minute is None:
            return None
        if old is None:
            return TokenBucket(per_minute / 60.0, per_minute, now)
        old._refill(now)
        old.rate_per_s, old.capacity = per_minute / 60.0, per_minute
        old._level = min(old._level, per_minute)
        return old

    def check(self, tokens: float, now: float, running: int = 0) -> LimitVerdict:
        """``running``: the tenant's requests running here that this limiter did not admit
        (admitted through Redis, before it went away)."""
        if self.max_concurrent is not None and self.concurrent + running >= self.max_concurrent:
            # Frees when one of the tenant's requests ends; no clock can say when.
            return LimitVerdict(False, 1.0, "max_concurrent")
        waits = []
        if self.rpm is not None:
            waits.append((self.rpm.wait_for(1, now), "requests_per_minute"))
        if self.tpm is not None:
            waits.append((self.tpm.wait_for(tokens, now), "tokens_per_minute"))
        wait, which = max(waits, default=(0.0, ""))
        if wait > 0:
            return LimitVerdict(False, wait, which)
        return LimitVerdict(True)

    def admit(self, tokens: float, now: float) -> None:
        if self.rpm is not None:
            self.rpm.take(1, now)
        if self.tpm is not None:
            self.tpm.take(tokens, now)
        self.concurrent += 1

    def settle(self, reserved: float, used: float | None, now: float) -> None:
        """The request ended: free its slot, give back the tokens it did not use and debit
        those it used past its reservation (the bucket may go below zero: the tenant's next
        requests wait until it has refilled past their own reservation). Unknown usage keeps
        the reservation as the charge."""
        self.concurrent = max(0, self.concurrent - 1)
        if self.tpm is None or used is None:
            return
        if used < reserved:
            self.tpm.give_back(reserved - used, now)
        elif used > reserved:
            self.tpm.take(used - reserved, now)


class TenantLimits(Protocol):
    """What the pipeline needs of tenant limits: this process's ``LimitRegistry`` or the
    replicas' shared one (``proxy.replicas.limits``). ``settle`` is given the ``hold`` of the
    verdict that admitted the request: that ties it to its admit."""

    def configure(self, tenants: list[Tenant], now: float) -> None: ...

    def apply_changes(self, changes: LimitChanges, now: float) -> None: ...

    async def admit(self, tenant: str, tokens: float, now: float) -> LimitVerdict: ...

    def settle(
        self, tenant: str, reserved: float, used: float | None, now: float, hold: str = ""
    ) -> None: ...

    def concurrent(self, tenant: str) -> int: ...

    def windows(self, tenant: str, now: float) -> dict[str, BucketWindow]: ...


def _limits_of(tenant: Tenant) -> tuple[float | None, float | None, int | None]:
    return tenant.requests_per_minute, tenant.tokens_per_minute, tenant.max_concurrent


@dataclass(frozen=True)
class LimitChanges:
    """What a reload changes in the limits, worked out off the event loop (``plan_changes``)
    so that applying it there costs O(changed tenants), not O(all tenants)."""

    names: frozenset[str]  # every tenant of the new config
    changed: tuple[Tenant, ...]  # new tenants and those whose limits changed
    removed: tuple[str, ...]  # tenants of the old config that the new one lacks


def plan_changes(old: Iterable[Tenant], new: Iterable[Tenant]) -> LimitChanges:
    """The difference in limits between two configs' tenants; touches no registry, so it may
    run in any thread."""
    before = {t.name: _limits_of(t) for t in old}
    after = list(new)
    names = frozenset(t.name for t in after)
    changed = tuple(t for t in after if before.get(t.name) != _limits_of(t))
    return LimitChanges(names, changed, tuple(n for n in before if n not in names))


class LimitRegistry:
    """Limiters of all tenants, kept across config reloads by tenant name."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, TenantLimiter] = {}
        # Removed from the config while they had requests running: dropped at a later reload.
        self._lingering: set[str] = set()

    def configure(self, tenants: list[Tenant], now: float) -> None:
        """Make the limiters those of ``tenants`` (O(all tenants))."""
        names = {t.name for t in tenants}
        self._lingering.clear()
        for name in list(self._by_tenant):
            if name not in names:
                self._drop(name)
        for tenant in tenants:
            self._set(tenant, now)

    def apply_changes(self, changes: LimitChanges, now: float) -> None:
        """``configure`` for a config whose difference from the one in force is ``changes``
        (``plan_changes`` against that config): O(changed tenants). Unchanged tenants keep
        their limiter as it is."""
        gone = [n for n in (*changes.removed, *self._lingering) if n not in changes.names]
        self._lingering.clear()
        for name in gone:
            self._drop(name)
        for tenant in changes.changed:
            self._set(tenant, now)

    def _drop(self, name: str) -> None:
        limiter = self._by_tenant.get(name)
        if limiter is None:
            return
        if limiter.concurrent == 0:
            del self._by_tenant[name]
        else:
            self._lingering.add(name)

    def _set(self, tenant: Tenant, now: float) -> None:
        limiter = self._by_tenant.get(tenant.name)
        if limiter is None:
            self._by_tenant[tenant.name] = TenantLimiter(tenant, now)
        else:
            limiter.update(tenant, now)

    def try_admit(self, tenant: str, tokens: float, now: float, running: int = 0) -> LimitVerdict:
        """``running``: as ``TenantLimiter.check``'s."""
        limiter = self._by_tenant.get(tenant)
        if limiter is None:
            return LimitVerdict(True)
        verdict = limiter.check(tokens, now, running)
        if verdict.allowed:
            limiter.admit(tokens, now)
            return LimitVerdict(True, windows=self.windows(tenant, now))
        return verdict

    async def admit(self, tenant: str, tokens: float, now: float) -> LimitVerdict:
        return self.try_admit(tenant, tokens, now)

    def settle(
        self, tenant: str, reserved: float, used: float | None, now: float, hold: str = ""
    ) -> None:
        # Keyed by nothing but the tenant: one settle per admission is the pipeline's promise
        # (its finally), so no client-chosen value can free or keep a slot here.
        limiter = self._by_tenant.get(tenant)
        if limiter is not None:
            limiter.settle(reserved, used, now)

    def windows(self, tenant: str, now: float) -> dict[str, BucketWindow]:
        """Read-only: the tenant's request and token buckets, by "requests" / "tokens"."""
        limiter = self._by_tenant.get(tenant)
        if limiter is None:
            return {}
        buckets = {"requests": limiter.rpm, "tokens": limiter.tpm}
        return {name: b.window(now) for name, b in buckets.items() if b is not None}

    def concurrent(self, tenant: str) -> int:
        limiter = self._by_tenant.get(tenant)
        return limiter.concurrent if limiter else 0
