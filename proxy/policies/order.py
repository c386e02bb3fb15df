"""The order inside one tenant's queue: a key per request, smaller first (ties: push order).

The key is computed once at push and must not depend on the current time (it lives in a heap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.policies.types import QueuedRequest


class RequestOrder(Protocol):
    def key(self, req: QueuedRequest) -> float: ...


def short_first_key(
    weighted_cost: float, arrival_s: float, *, reference_tokens: float, aging_s: float
) -> float:
    """key = min(cost / reference, 1) + arrival / aging_s. Since the cost term lies in [0, 1], a
    request is never overtaken by one that arrived ``aging_s`` or more after it: a long
    document waits behind short questions for at most that long plus the work ahead of it."""
    return min(weighted_cost / reference_tokens, 1.0) + arrival_s / aging_s


class ShortFirst:
    """Short requests first, with aging (see ``short_first_key``)."""

    def __init__(self, *, reference_tokens: float, aging_s: float) -> None:
        self.reference_tokens = reference_tokens
        self.aging_s = aging_s

    def key(self, req: QueuedRequest) -> float:
        return short_first_key(
            req.cost, req.arrival_s, reference_tokens=self.reference_tokens, aging_s=self.aging_s
        )


class Fcfs:
    """Arrival order."""

    def key(self, req: QueuedRequest) -> float:
        return req.arrival_s
