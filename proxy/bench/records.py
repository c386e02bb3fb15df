"""What one benchmark request was meant to be, and what happened to it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    """How a request ended. ``LOST`` means no definitive answer: it must stay at zero."""

    OK = "ok"
    RATE_LIMITED = "429"
    UNAVAILABLE = "503"
    TIMEOUT = "504"
    ERROR = "error"
    LOST = "lost"


OUTCOMES: tuple[Outcome, ...] = tuple(Outcome)


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the open-loop plan; ``at`` is seconds after the run starts."""

    index: int
    at: float
    tenant: str
    tier: str
    key: str
    prompt: str
    max_tokens: int


@dataclass
class RequestRecord:
    """Timings are seconds after the run's start, measured on the monotonic clock.

    ``scheduled`` is when the open loop meant to send the request; latencies count from it, so
    time spent waiting anywhere (client connection pool, proxy queue, vLLM queue) is included.
    """

    index: int
    tenant: str
    tier: str
    scheduled: float
    outcome: Outcome = Outcome.LOST
    sent: float | None = None
    status: int | None = None
    first_token: float | None = None
    end: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.scheduled

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.scheduled

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def weighted_tokens(self) -> int:
        """The fairness currency: input + 2 x output tokens."""
        return (self.prompt_tokens or 0) + 2 * (self.output_tokens or 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "tenant": self.tenant,
            "tier": self.tier,
            "outcome": self.outcome.value,
            "status": self.status,
            "scheduled": _r(self.scheduled),
            "sent": _r(self.sent),
            "first_token": _r(self.first_token),
            "end": _r(self.end),
            "ttft": _r(self.ttft),
            "e2e": _r(self.e2e),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "token_times": [round(t, 4) for t in self.token_times],
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(
            index=int(data["index"]),
            tenant=str(data["tenant"]),
            tier=str(data["tier"]),
            scheduled=float(data["scheduled"]),
            outcome=Outcome(data["outcome"]),
            sent=data.get("sent"),
            status=data.get("status"),
            first_token=data.get("first_token"),
            end=data.get("end"),
            prompt_tokens=data.get("prompt_tokens"),
            output_tokens=data.get("output_tokens"),
            token_times=[float(t) for t in data.get("token_times", [])],
            error=data.get("error"),
        )


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
