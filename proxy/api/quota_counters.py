"""The quota counters (``quota:``), defined once: each one's name (its YAML key, its Redis key's
part, its ``limit`` label), what it measures, over which UTC period, the error code that refuses
it and its label in ``tierproxy top``. Every reader (the gate, billing, the refusal, ``top``,
the Redis keys, the docs' test) goes through this table; adding a counter is a row here and a
field on ``proxy.config.quotas.Quota`` (a unit test ties the two).

It lives with the OpenAI vocabulary, the lowest floor, so that every layer can read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Measure = Literal["tokens", "cost"]
Span = Literal["day", "month"]


@dataclass(frozen=True)
class QuotaCounter:
    name: str
    measure: Measure  # tokens: prompt + output tokens; cost: money, in `pricing`'s currency
    span: Span  # the UTC period it counts over (proxy.scheduling.quotas.period)
    code: str  # the refusal's error code
    label: str  # its column label in `tierproxy top`

    @property
    def money(self) -> bool:
        return self.measure == "cost"

    @property
    def period_text(self) -> str:
        """How the refusal names its period: "day (UTC)"."""
        return f"{self.span} (UTC)"


COUNTERS: Mapping[str, QuotaCounter] = {
    c.name: c
    for c in (
        QuotaCounter("tokens_per_day", "tokens", "day", "quota_exceeded", "tok/d"),
        QuotaCounter("tokens_per_month", "tokens", "month", "quota_exceeded", "tok/mo"),
        QuotaCounter("budget_per_day", "cost", "day", "budget_exceeded", "$/d"),
        QuotaCounter("budget_per_month", "cost", "month", "budget_exceeded", "$/mo"),
    )
}
