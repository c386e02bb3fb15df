"""Per-tenant quotas of tokens and money per UTC day and calendar month (``quota:``).

A request reserves its worst case on every counter its tenant has before it runs; it is refused
when any of them would go past its limit, with a Retry-After to that period's reset. When it
ends it settles to its real usage (a reservation is corrected in the period it was made in,
even when the request ended after the boundary). Unlike the per-minute limits nothing refills:
a period's counter starts at zero when the period starts.

``QuotaLedger`` keeps this process's counters, on a wall clock passed in (so a test crosses a
month's end without waiting); ``proxy.replicas.quotas`` keeps them in Redis for all replicas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from proxy.api.quota_counters import COUNTERS, Span


def period(span: Span, wall: float) -> tuple[str, float]:
    """The UTC period holding ``wall`` (Unix seconds): its name ("2026-12-01", "2026-12") and
    the Unix time it ends (the next midnight, the 1st of the next month)."""
    at = datetime.fromtimestamp(wall, UTC)
    if span == "day":
        start = datetime(at.year, at.month, at.day, tzinfo=UTC)
        return start.strftime("%Y-%m-%d"), (start + timedelta(days=1)).timestamp()
    if span != "month":  # a span without its arithmetic here must not count as a month
        raise ValueError(f"no period arithmetic for span {span!r}")
    nxt = datetime(at.year + at.month // 12, at.month % 12 + 1, 1, tzinfo=UTC)
    return f"{at.year:04d}-{at.month:02d}", nxt.timestamp()


@dataclass(frozen=True)
class QuotaAsk:
    """One request's reservation: its tenant's quotas and its worst case."""

    tenant: str
    limits: Mapping[str, float]  # counter name -> limit (Quota.limits())
    tokens: float
    cost: float

    def amount(self, counter: str) -> float:
        return self.tokens if COUNTERS[counter].measure == "tokens" else self.cost


@dataclass(frozen=True)
class QuotaHold:
    """What a request reserved, to settle when it ends: the counters and periods it charged."""

    tenant: str
    periods: tuple[tuple[str, str], ...]  # (counter, period name)
    tokens: float
    cost: float
    shared: bool = False  # reserved in Redis (else in this process's ledger)
    op: str = ""  # the reservation's id in Redis (its settle is applied once, by that id)

    def amount(self, counter: str) -> float:
        """What it reserved on ``counter``."""
        return self.tokens if COUNTERS[counter].measure == "tokens" else self.cost

    def delta(self, counter: str, tokens: float | None, cost: float | None) -> float:
        """Real usage minus the reservation on ``counter``; 0 when the usage is unknown (the
        reservation stays the charge)."""
        if COUNTERS[counter].measure == "tokens":
            return 0.0 if tokens is None else tokens - self.tokens
        return 0.0 if cost is None else cost - self.cost


@dataclass(frozen=True)
class QuotaVerdict:
    allowed: bool
    hold: QuotaHold | None = None
    which: str = ""  # the counter that said no (the one whose reset is furthest)
    limit: float = 0.0
    used: float = 0.0
    asked: float = 0.0
    retry_after_s: float = 0.0  # until that counter's period resets


def decide(
    ask: QuotaAsk, used: Mapping[str, float], wall: float, shared: bool = False
) -> QuotaVerdict:
    """All or nothing: refused when any counter would pass its limit; the refusal names the
    counter that frees last."""
    refusal: QuotaVerdict | None = None
    periods = []
    for counter, limit in ask.limits.items():
        name, resets_at = period(COUNTERS[counter].span, wall)
        periods.append((counter, name))
        amount, now_used = ask.amount(counter), used.get(counter, 0.0)
        if amount > 0 and now_used + amount > limit:
            wait = resets_at - wall
            if refusal is None or wait > refusal.retry_after_s:
                refusal = QuotaVerdict(False, None, counter, limit, now_used, amount, wait)
    if refusal is not None:
        return refusal
    return QuotaVerdict(True, QuotaHold(ask.tenant, tuple(periods), ask.tokens, ask.cost, shared))


def still_covered(
    holds: Sequence[QuotaHold], limits: Mapping[str, float], used: Mapping[str, float], wall: float
) -> list[QuotaVerdict]:
    """The verdicts of a tenant's waiting requests under its new ``limits`` (a reload changed
    them), in queue order (``holds``: what each reserved, earliest first): ``used`` is each
    counter's use as the book knows it, those reservations included. Each is decided as at
    admission (``decide``) against the use without any of them plus the ones kept before it:
    the earliest stay while the new limits cover them, the rest are refused (their
    reservations to be given back)."""
    names = {c: period(COUNTERS[c].span, wall)[0] for c in limits}
    base = dict.fromkeys(limits, 0.0) | {c: v for c, v in used.items() if c in limits}
    for hold in holds:  # what they reserved in the current periods comes off
        for counter, name in hold.periods:
            if names.get(counter) == name:
                base[counter] -= hold.amount(counter)
    verdicts = []
    for hold in holds:
        ask = QuotaAsk(hold.tenant, limits, hold.tokens, hold.cost)
        verdict = decide(ask, base, wall, hold.shared)
        if verdict.allowed:
            for counter in limits:
                base[counter] += ask.amount(counter)
        verdicts.append(verdict)
    return verdicts


class QuotaBook(Protocol):
    """What the pipeline needs of quotas: this process's ``QuotaLedger`` or the replicas'
    shared one (``proxy.replicas.quotas``)."""

    async def reserve(self, ask: QuotaAsk, wall: float) -> QuotaVerdict: ...

    def settle(self, hold: QuotaHold, tokens: float | None, cost: float | None) -> None: ...

    def usage(self, tenant: str, limits: Mapping[str, float], wall: float) -> dict[str, Any]: ...


class QuotaLedger:
    """The counters of this process: per tenant and counter, the current period's use. A new
    period replaces the old one's entry, so memory stays four numbers per tenant."""

    def __init__(self) -> None:
        self._used: dict[tuple[str, str], tuple[str, float]] = {}

    def get(self, tenant: str, counter: str, name: str) -> float:
        held = self._used.get((tenant, counter))
        return held[1] if held is not None and held[0] == name else 0.0

    def put(self, tenant: str, counter: str, name: str, value: float) -> None:
        """Set a counter (what Redis says it is, for the shared ledger's fallback)."""
        held = self._used.get((tenant, counter))
        if held is None or held[0] <= name:  # never back to an older period
            self._used[(tenant, counter)] = (name, value)

    def add(self, tenant: str, counter: str, name: str, amount: float) -> bool:
        """Add to the counter of period ``name``; False (nothing done) when that period is no
        longer this ledger's current one: it is over, what it counted no longer matters."""
        held = self._used.get((tenant, counter))
        if held is not None and held[0] > name:
            return False
        base = held[1] if held is not None and held[0] == name else 0.0
        self._used[(tenant, counter)] = (name, base + amount)
        return True

    def try_reserve(self, ask: QuotaAsk, wall: float) -> QuotaVerdict:
        used = {c: self.get(ask.tenant, c, period(COUNTERS[c].span, wall)[0]) for c in ask.limits}
        verdict = decide(ask, used, wall)
        if verdict.hold is not None:
            for counter, name in verdict.hold.periods:
                self.add(ask.tenant, counter, name, ask.amount(counter))
        return verdict

    async def reserve(self, ask: QuotaAsk, wall: float) -> QuotaVerdict:
        return self.try_reserve(ask, wall)

    def settle(self, hold: QuotaHold, tokens: float | None, cost: float | None) -> None:
        for counter, name in hold.periods:
            delta = hold.delta(counter, tokens, cost)
            if delta:
                self.add(hold.tenant, counter, name, delta)

    def usage(self, tenant: str, limits: Mapping[str, float], wall: float) -> dict[str, Any]:
        """For /admin/status: each quota's use in the current period, its limit and its reset."""
        out: dict[str, Any] = {}
        for counter, limit in limits.items():
            name, resets_at = period(COUNTERS[counter].span, wall)
            out[counter] = {
                "used": round(self.get(tenant, counter, name), 6),
                "limit": limit,
                "period": name,
                "resets_in_s": round(resets_at - wall, 1),
            }
        return out
