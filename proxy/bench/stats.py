"""Statistics on request records: percentiles, summaries, goodput, Jain's fairness index.

Pure functions on plain data, so that they can be checked on known numbers.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from proxy.bench.records import Outcome, RequestRecord

# Input tokens count once, output tokens twice: the proxy's fairness currency (DESIGN.md).
OUTPUT_TOKEN_WEIGHT = 2


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def summarize(values: Sequence[float]) -> Summary | None:
    """p50/p90/p99/max and mean of some latencies; None when there are none."""
    if not values:
        return None
    return Summary(
        count=len(values),
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
        max=max(values),
    )


def jain_index(shares: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when equal, 1/n when one takes all."""
    if not shares:
        raise ValueError("Jain's index of no shares")
    if any(x < 0 for x in shares):
        raise ValueError("Jain's index needs non-negative shares")
    top = max(shares)
    if top == 0:
        return 1.0
    # Scaled to the largest share: tiny shares would underflow when squared (index > 1).
    scaled = [x / top for x in shares]
    index = sum(scaled) ** 2 / (len(scaled) * sum(x * x for x in scaled))
    return min(1.0, index)


@dataclass(frozen=True)
class Slo:
    """A tier's service-level objective: first token within ttft_s, whole answer within e2e_s,
    tokens after the first itl_s apart on average."""

    ttft_s: float
    e2e_s: float | None = None
    itl_s: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if record.outcome is not Outcome.OK or record.ttft is None or record.e2e is None:
            return False
        if record.ttft > self.ttft_s:
            return False
        itls = record.itls
        if self.itl_s is not None and itls and sum(itls) / len(itls) > self.itl_s:
            return False
        return self.e2e_s is None or record.e2e <= self.e2e_s


@dataclass(frozen=True)
class Goodput:
    rps: float  # requests per second that ended ok within the SLO
    attainment: float  # share of all requests sent that ended ok within the SLO


def goodput(records: Sequence[RequestRecord], slo: Slo, window_s: float) -> Goodput:
    """Requests that met the SLO, as a rate over ``window_s`` and as a share of all sent."""
    if window_s <= 0:
        raise ValueError("goodput needs a positive window")
    met = sum(1 for r in records if slo.met_by(r))
    return Goodput(rps=met / window_s, attainment=met / len(records) if records else 0.0)


def makespan(records: Iterable[RequestRecord]) -> float:
    """From the first scheduled send to the last answer (or schedule, if none answered)."""
    starts: list[float] = []
    ends: list[float] = []
    for r in records:
        starts.append(r.scheduled)
        ends.append(r.end if r.end is not None else r.scheduled)
    if not starts:
        return 0.0
    return max(ends) - min(starts)


@dataclass(frozen=True)
class Fairness:
    """Weighted-token service rates of one tier's tenants while they were backlogged together."""

    index: float | None  # Jain's index over ``rates``; None with fewer than two tenants
    rates: dict[str, float]  # weighted tokens per second while backlogged
    backlogged_s: dict[str, float]  # seconds each tenant counted as backlogged with another


def backlogged_fairness(
    records: Sequence[RequestRecord], bin_s: float = 1.0, min_cover: float = 0.9
) -> Fairness:
    """Jain's index of weighted-token service (input + 2 x output) among backlogged tenants.

    Time is cut into bins of ``bin_s``. A tenant is backlogged in a bin when it had a request
    outstanding (scheduled, not yet answered) for at least ``min_cover`` of it. Only bins with
    two or more backlogged tenants count. A tenant's rate is the service it received in the bins
    where it was backlogged, divided by their length; the index compares those rates, so a
    tenant that asks for less than its share and is never backlogged does not count as starved.
    Service is placed in time as it happens: prompt tokens at the first token, output tokens
    spread over the streamed chunks.
    """
    if bin_s <= 0:
        raise ValueError("bin_s must be positive")
    if not records:
        return Fairness(index=None, rates={}, backlogged_s={})
    origin = min(r.scheduled for r in records)
    horizon = max((r.end if r.end is not None else r.scheduled) for r in records)
    nbins = max(1, math.ceil((horizon - origin) / bin_s))

    cover: dict[str, list[float]] = defaultdict(lambda: [0.0] * nbins)
    service: dict[str, list[float]] = defaultdict(lambda: [0.0] * nbins)
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_tenant[r.tenant].append(r)

    def bin_of(t: float) -> int:
        return min(nbins - 1, max(0, int((t - origin) / bin_s)))

    for tenant, rs in by_tenant.items():
        spans = sorted((r.scheduled, r.end if r.end is not None else r.scheduled) for r in rs)
        for start, end in _merge(spans):
            _add_cover(cover[tenant], origin, bin_s, start, end)
        for r in rs:
            if r.first_token is not None and r.prompt_tokens:
                service[tenant][bin_of(r.first_token)] += r.prompt_tokens
            if r.token_times:
                produced = r.output_tokens if r.output_tokens is not None else len(r.token_times)
                per_chunk = OUTPUT_TOKEN_WEIGHT * produced / len(r.token_times)
                for t in r.token_times:
                    service[tenant][bin_of(t)] += per_chunk

    got: dict[str, float] = defaultdict(float)
    counted: dict[str, int] = defaultdict(int)
    for b in range(nbins):
        backlogged = [t for t in by_tenant if cover[t][b] >= min_cover * bin_s]
        if len(backlogged) < 2:
            continue
        for tenant in backlogged:
            got[tenant] += service[tenant][b]
            counted[tenant] += 1
    rates = {t: got[t] / (counted[t] * bin_s) for t in sorted(counted)}
    index = jain_index(list(rates.values())) if len(rates) >= 2 else None
    return Fairness(
        index=index, rates=rates, backlogged_s={t: counted[t] * bin_s for t in sorted(counted)}
    )


def _merge(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _add_cover(cover: list[float], origin: float, bin_s: float, start: float, end: float) -> None:
    """Add the overlap of [start, end) with each bin to ``cover``."""
    if end <= start:
        return
    first = max(0, int((start - origin) / bin_s))
    last = min(len(cover) - 1, int((end - origin) / bin_s))
    for b in range(first, last + 1):
        lo = origin + b * bin_s
        overlap = min(end, lo + bin_s) - max(start, lo)
        if overlap > 0:
            cover[b] += overlap


@dataclass(frozen=True)
class LatencySpread:
    """TTFT of tenants that asked for the same service: a fair proxy serves them alike."""

    p50: dict[str, float]
    p99: dict[str, float]
    p50_ratio: float  # slowest tenant's p50 over the fastest's; 1.0 is equal
    p99_ratio: float


def latency_spread(ttft_by_tenant: Mapping[str, Sequence[float]]) -> LatencySpread | None:
    """p50 / p99 TTFT per tenant and their max/min ratios; None with fewer than two tenants
    that have latencies (or a zero p50, which no ratio can compare)."""
    measured = {t: v for t, v in sorted(ttft_by_tenant.items()) if v}
    if len(measured) < 2:
        return None
    p50 = {t: percentile(v, 50) for t, v in measured.items()}
    p99 = {t: percentile(v, 99) for t, v in measured.items()}
    if min(p50.values()) <= 0 or min(p99.values()) <= 0:
        return None
    return LatencySpread(
        p50=p50,
        p99=p99,
        p50_ratio=max(p50.values()) / min(p50.values()),
        p99_ratio=max(p99.values()) / min(p99.values()),
    )


def ttft_ms_by_tier(firsts: Iterable[tuple[str, float | None]]) -> dict[str, tuple[float, ...]]:
    """Each tier's times to first token (``(tier, seconds)``; None: no first token) in ms,
    sorted, tiers in the order they first come."""
    out: dict[str, list[float]] = {}
    for tier, ttft in firsts:
        values = out.setdefault(tier, [])
        if ttft is not None:
            values.append(1000 * ttft)
    return {tier: tuple(sorted(values)) for tier, values in out.items() if values}


# Runs compared pair by pair from this many: n pairs cannot show a p-value under 1 / 2**n,
# doubled when tested against the better of two (``p99_excess_over_better``): 2/64 < 0.05.
MIN_PAIRS = 6


@dataclass(frozen=True)
class TailTest:
    """How likely a p99 this much worse is from the draw alone, and how it was tested."""

    p: float
    paired: bool  # runs compared pair by pair (else single values: too ready to call it real)


def p99_excess_test(
    mine: Sequence[Sequence[float]],
    other: Sequence[Sequence[float]],
    rounds: int = 2000,
    seed: int = 0,
) -> TailTest:
    """How often ``mine``'s p99 would exceed ``other``'s by as much as it does if the two
    policies were alike (a one-sided permutation test of the p99 ratio): under 0.05, the
    difference is the policies', not the draw's. Each argument is one or more runs' values,
    run i of both drawn alike (the same clients).

    Of ``MIN_PAIRS`` runs or more with values on both sides, the runs are compared pair by
    pair (the sum of their p99s' log ratios, each pair's sign flipped): what happens at the
    same instant of every run (a start-up burst) counts as often as it recurs. A shape runs
    that often only when each run has a few dozen values, so a run's p99 is near its slowest
    value. Of fewer, single values swap sides: they are not independent (a burst slows many
    at once), so that test calls a difference real more readily than it should."""
    if len(mine) != len(other):
        raise ValueError("runs are compared pair by pair")

    def ratio(a: Sequence[float], b: Sequence[float]) -> float:
        return percentile(a, 99) / max(percentile(b, 99), 1e-12)

    pairs = [(m, o) for m, o in zip(mine, other, strict=True) if m and o]
    ones, others = [v for run in mine for v in run], [v for run in other for v in run]
    if not ones or not others:
        return TailTest(1.0, paired=False)
    rng = random.Random(seed)
    if len(pairs) >= MIN_PAIRS:
        logs = [math.log(max(ratio(m, o), 1e-12)) for m, o in pairs]
        observed = sum(logs) - 1e-12
        if 2 ** len(logs) <= rounds:  # every sign pattern, the observed one among them
            signs = list(itertools.product((1, -1), repeat=len(logs)))
            at_least = sum(
                sum(s * d for s, d in zip(sg, logs, strict=True)) >= observed for sg in signs
            )
            return TailTest(at_least / len(signs), paired=True)
        at_least = sum(
            sum(rng.choice((1, -1)) * d for d in logs) >= observed for _ in range(rounds)
        )
        return TailTest((1 + at_least) / (1 + rounds), paired=True)
    observed = ratio(ones, others) - 1e-12
    pooled = [*ones, *others]
    at_least = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        at_least += ratio(pooled[: len(ones)], pooled[len(ones) :]) >= observed
    # The observed arrangement counts as one of the draws: never a p-value of 0.
    return TailTest((1 + at_least) / (1 + rounds), paired=False)


def p99_excess_over_better(
    mine: Sequence[Sequence[float]], others: Sequence[Sequence[Sequence[float]]]
) -> TailTest:
    """Whether ``mine``'s p99 is worse than the better of ``others``' beyond the draw: worse
    than at least one of them (each tested where ``mine``'s p99 is higher), its p-value
    Bonferroni-corrected for the choice (testing against whichever measured faster alone
    calls twice as many draws real as it should)."""
    flat = [v for run in mine for v in run]
    if not flat:
        return TailTest(1.0, paired=False)
    p99 = percentile(flat, 99)
    tests = [
        p99_excess_test(mine, other)
        for other in others
        if (values := [v for run in other for v in run]) and percentile(values, 99) < p99
    ]
    if not tests:
        return TailTest(1.0, paired=False)
    best = min(tests, key=lambda t: t.p)
    return TailTest(min(1.0, len(others) * best.p), paired=best.paired)
