"""The memory budget: bytes the proxy holds for requests it has accepted but not yet sent.

A queued request keeps its parsed body until a backend takes it; without a bound, a flood of
large bodies grows the heap until the process dies (93 queued 8 MB requests: 1.4 GiB RSS). Each
request reserves an estimate of what it holds before it waits anywhere (tenant limit, queue);
over the budget, it is refused at once with a Retry-After instead. An upload is reserved before
its body is read: its whole estimate up front when its Content-Length is known, else as its
chunks arrive (``Reservation.grow``), so concurrent uploads cannot pass the budget either.
"""

from __future__ import annotations

# Parsed JSON held per byte of a typical body (an 8 MB string prompt 1.0x, token ids 5.7x); not
# a bound: tiny containers hold 24x. A parsed request reserves its measured shape instead
# (proxy.request.jsonshape, JsonShape.held_bytes).
HELD_PER_BODY_BYTE = 6


def held_estimate(body_bytes: int) -> int:
    return body_bytes * HELD_PER_BODY_BYTE


class Reservation:
    """Bytes held for one request; released exactly once (idempotent)."""

    __slots__ = ("_budget", "amount")

    def __init__(self, budget: MemoryBudget, amount: int) -> None:
        self._budget: MemoryBudget | None = budget
        self.amount = amount

    def grow(self, extra: int) -> bool:
        """Reserve ``extra`` more bytes for the same request (an upload as it arrives); False,
        changing nothing, when they do not fit. Alone in the budget, a request may pass it (as
        ``try_reserve``: no valid request is refused forever)."""
        budget = self._budget
        if budget is None or extra <= 0:
            return budget is not None
        others = budget.held - self.amount
        limit = budget.limit_bytes
        if limit is not None and others > 0 and budget.held + extra > limit:
            return False
        budget.held += extra
        self.amount += extra
        return True

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.held -= self.amount


class MemoryBudget:
    """All reservations together stay within ``limit_bytes`` (None: unbounded). A request
    larger than the whole budget still passes when nothing else is held, so that no valid
    request is refused forever."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes
        self.held = 0

    def try_reserve(self, amount: int) -> Reservation | None:
        limit = self.limit_bytes
        if limit is not None and self.held > 0 and self.held + amount > limit:
            return None
        self.held += amount
        return Reservation(self, amount)

    def try_reserve_spare(self, amount: int) -> Reservation | None:
        """``amount`` only while all that is held stays within half the budget: for bytes that
        merely help (a lagging client's read-ahead, ``proxy.relay.clientsend``), never at the
        cost of the requests' own."""
        limit = self.limit_bytes
        if limit is not None and self.held + amount > limit // 2:
            return None
        self.held += amount
        return Reservation(self, amount)
