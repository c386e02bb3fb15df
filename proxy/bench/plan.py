"""The open-loop plan: every request of a run, with its send time, fixed before the run starts.

The same scenario, rate and seed give the same plan, so the proxy run and the direct run send
exactly the same requests at exactly the same offsets.
"""

from __future__ import annotations

import random

from proxy.bench.arrivals import Segment, arrivals
from proxy.bench.records import PlannedRequest
from proxy.bench.scenario import Scenario, TenantLoad

_TEXT = (
    "the of and to in is that it for on with as was at by an be this from or are have not but "
    "what all were when we there can more if out so up said about into than them only time "
    "some could like other then now look also come its two way well first any new because day "
    "use market river system report model table price answer letter number water city field "
    "power light voice paper music order plant money story place group point world house "
    "state"
)
_WORDS = tuple(_TEXT.split())


def segments(scenario: Scenario, rate_rps: float, duration_s: float | None) -> list[Segment]:
    """The scenario's phases as absolute-rate segments for the whole scenario rate."""
    out: list[Segment] = []
    t = 0.0
    for phase in scenario.timeline(duration_s):
        out.append(Segment(start=t, end=t + phase.duration_s, rate=rate_rps * phase.factor))
        t += phase.duration_s
    return out


def make_prompt(rng: random.Random, tenant: TenantLoad, serial: int, words: int) -> str:
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    if tenant.kind == "document":
        return f"Document {tenant.name}-{serial}. Summarise it.\n\n{body}"
    return f"Question {tenant.name}-{serial}: {body}?"


def build_plan(
    scenario: Scenario, rate_rps: float, seed: int, duration_s: float | None = None
) -> list[PlannedRequest]:
    """Every request of the run in send order. Raises ValueError past scenario.max_requests."""
    if rate_rps <= 0:
        raise ValueError("the rate must be positive")
    segs = segments(scenario, rate_rps, duration_s)
    total_share = sum(t.share for t in scenario.tenants)
    planned: list[tuple[float, int, TenantLoad, str, int]] = []
    budget = scenario.max_requests
    for order, tenant in enumerate(scenario.tenants):
        # One generator per tenant, seeded by name: adding a tenant leaves the others' traffic
        # unchanged.
        rng = random.Random(f"{seed}:{tenant.name}")
        fraction = tenant.share / total_share
        mine = [Segment(s.start, s.end, s.rate * fraction) for s in segs]
        arrival = tenant.arrival or scenario.arrival
        try:
            times = arrivals(mine, arrival.effective_cv, rng, budget - len(planned))
        except ValueError as exc:
            raise ValueError(
                f"scenario {scenario.name} at {rate_rps:.2f} req/s plans more than"
                f" {scenario.max_requests} requests (max_requests): {exc}"
            ) from exc
        for serial, at in enumerate(times):
            words = rng.randint(*tenant.prompt_words)
            max_tokens = rng.randint(*tenant.max_tokens)
            planned.append((at, order, tenant, make_prompt(rng, tenant, serial, words), max_tokens))
    planned.sort(key=lambda p: (p[0], p[1]))
    return [
        PlannedRequest(
            index=i,
            at=at,
            tenant=tenant.name,
            tier=tenant.tier,
            key=tenant.api_key,
            prompt=prompt,
            max_tokens=max_tokens,
        )
        for i, (at, _, tenant, prompt, max_tokens) in enumerate(planned)
    ]
