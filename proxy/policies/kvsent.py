"""What ``backends: kv_aware`` counted when it sent a request (``proxy.policies.kvaware``):
undone if the engine does not run it, so that what never ran moves no tenant's placement."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Sent:
    """What sending one request counted, undone if the engine does not run it."""

    url: str
    at: float
    filled: float  # its weight in the shares lately
    tenant: str
    tier: str
    shown: int | None = None  # its prompt's leading blocks the index showed then (None: cold)
    rehomed: tuple[int, str, float] | None = None  # (branch point, its home before, when moved)
