"""Per-tenant limits: requests per minute, tokens per minute, concurrent requests.

Token buckets on an injected clock rather than aiolimiter: the proxy must answer *how long*
to wait (an accurate ``Retry-After``), give back the unused part of a token reservation once
the real ``usage`` is known, and be tested over a simulated minute without sleeping; aiolimiter
exposes none of these (its level is private and it reads the event loop's clock).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import Tenant


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
        # A request bigger than the whole bucket waits for a full bucket, then goes.
        need = min(amount, self.capacity) - self._level
        return max(0.0, need / self.rate_per_s)

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self._level -= amount  # may go negative for oversize requests: they pay it off later

    def window(self, now: float) -> BucketWindow:
        """Read-only: what the x-ratelimit-* headers report."""
        level = min(self.capacity, self._level + max(0.0, now - self._at) * self.rate_per_s)
        return BucketWindow(self.capacity, level, (self.capacity - level) / self.rate_per_s)

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self._level = min(self.capacity, self._level + amount)


@dataclass(frozen=True)
class BucketWindow:
    limit: float
    remaining: float  # below zero while a tenant pays off usage past its reservation
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True)
class LimitVerdict:
    allowed: bool
    retry_after_s: float = 0.0
    limit: str = ""  # which limit said no: requests_per_minute | tokens_per_minute | max_concurrent


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

    def check(self, tokens: float, now: float) -> LimitVerdict:
        if self.max_concurrent is not None and self.concurrent >= self.max_concurrent:
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


class LimitRegistry:
    """Limiters of all tenants, kept across config reloads by tenant name."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, TenantLimiter] = {}

    def configure(self, tenants: list[Tenant], now: float) -> None:
        names = {t.name for t in tenants}
        for name in list(self._by_tenant):
            if name not in names and self._by_tenant[name].concurrent == 0:
                del self._by_tenant[name]
        for tenant in tenants:
            limiter = self._by_tenant.get(tenant.name)
            if limiter is None:
                self._by_tenant[tenant.name] = TenantLimiter(tenant, now)
            else:
                limiter.update(tenant, now)

    def try_admit(self, tenant: str, tokens: float, now: float) -> LimitVerdict:
        limiter = self._by_tenant.get(tenant)
        if limiter is None:
            return LimitVerdict(True)
        verdict = limiter.check(tokens, now)
        if verdict.allowed:
            limiter.admit(tokens, now)
        return verdict

    def settle(self, tenant: str, reserved: float, used: float | None, now: float) -> None:
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
