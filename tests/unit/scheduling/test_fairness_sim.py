"""A discrete-event simulation of the queue in front of a 4-slot backend, on a fake clock:
tenants of one tier sending Poisson streams at different rates."""

from __future__ import annotations

import heapq
import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.policies.types import QueuedRequest, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.queue import AdmissionQueue


def _jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


@dataclass
class SimResult:
    waits: dict[str, list[float]]
    served: list[tuple[str, float]]  # (tenant, weighted tokens) in dispatch order


def _simulate(
    rates: Mapping[str, float],
    seconds: float,
    slots: int = 4,
    tokens_per_s: float = 400.0,
    seed: int = 7,
    streams: Mapping[str, int] | None = None,
) -> SimResult:
    """``streams``: the random seed of each tenant's arrivals (default: from ``seed``)."""
    q = AdmissionQueue(
        {"normal": TierLimits(1.0, 10**6, 10**6)},
        default_queue_policies(aging_s=60, reference_tokens=8192),
    )
    arrivals: list[tuple[float, str]] = []
    for index, (tenant, rate) in enumerate(rates.items()):
        rng = random.Random(streams[tenant] if streams else seed * 1000 + index)
        t = 0.0
        while t < seconds:
            t += rng.expovariate(rate)
            arrivals.append((t, tenant))
    arrivals.sort()
    busy: list[float] = []  # end times of running requests
    result = SimResult(waits={tenant: [] for tenant in rates}, served=[])
    i = 0
    while i < len(arrivals) or len(q) or busy:
        next_arrival = arrivals[i][0] if i < len(arrivals) else float("inf")
        next_done = busy[0] if busy else float("inf")
        now = min(next_arrival, next_done)
        if now == next_done:
            heapq.heappop(busy)
        else:
            tenant = arrivals[i][1]
            q.push(
                QueuedRequest(
                    "normal", tenant, prompt_tokens=60, expected_output=40, arrival_s=now
                ),
                now,
            )
            i += 1
        while len(busy) < slots and (req := q.pop()) is not None:
            result.waits[req.tenant].append(now - req.arrival_s)
            result.served.append((req.tenant, req.cost))
            heapq.heappush(busy, now + (req.prompt_tokens + req.expected_output) / tokens_per_s)
    return result


def test_backlogged_tenants_get_equal_weighted_token_service_per_window() -> None:
    # Capacity: 4 slots / 0.25 s = 16 req/s. Offered: heavy 100/s + light 20/s: both stay
    # backlogged (the light one still sends more than its fair 8/s).
    served = _simulate({"heavy": 100, "light": 20}, seconds=60).served
    window = 100
    # Per window of 100 dispatches while both are sending:
    for start in range(0, 900, window):  # 16 req/s: the first ~56 s, while both send
        chunk = served[start : start + window]
        per = {"heavy": 0.0, "light": 0.0}
        for tenant, cost in chunk:
            per[tenant] += cost
        assert _jain(list(per.values())) >= 0.95, (start, per)


def test_light_tenant_wait_stays_near_unloaded_under_a_heavy_flood() -> None:
    # Light sends 2/s (well under its fair share): alone, it barely waits.
    waits_alone = _simulate({"heavy": 1e-9, "light": 2}, seconds=60).waits["light"]
    flooded = _simulate({"heavy": 80, "light": 2}, seconds=60).waits
    mean_alone = statistics.mean(waits_alone)
    mean_flooded = statistics.mean(flooded["light"])
    # The heavy tenant queues for seconds; the light one waits at most about one service time.
    assert statistics.mean(flooded["heavy"]) > 5.0
    assert mean_flooded < mean_alone + 0.25, (mean_alone, mean_flooded)


def test_identical_tenants_wait_alike() -> None:
    """Latency fairness: three identical light tenants beside a flood. Each returns from idle
    lifted to the same counter, so they tie often; the tie must go to whoever has waited
    longest, not to a name. Every light tenant plays every arrival stream once (rotations), so
    the streams' own luck cancels and only the scheduler's treatment of names remains."""
    lights = ("light-a", "light-b", "light-c")
    waits: dict[str, list[float]] = {name: [] for name in lights}
    heavy: list[float] = []
    for seed in (11, 12):
        for rotation in range(len(lights)):
            streams = {"heavy": seed * 100}
            streams |= {n: seed * 100 + 1 + (i + rotation) % 3 for i, n in enumerate(lights)}
            result = _simulate(
                {"heavy": 40.0, **dict.fromkeys(lights, 1.0)}, seconds=30, slots=1, streams=streams
            )
            for name in lights:
                waits[name] += result.waits[name]
            heavy += result.waits["heavy"]
    assert statistics.mean(heavy) > 5.0  # the tier is saturated
    means = [statistics.mean(waits[name]) for name in lights]
    p90s = [statistics.quantiles(waits[name], n=10)[-1] for name in lights]
    # Identical demand, identical service: the spread is a small share of the wait itself.
    assert max(means) - min(means) < 0.05 * statistics.mean(means), means
    assert max(p90s) - min(p90s) < 0.05 * statistics.mean(p90s), p90s
