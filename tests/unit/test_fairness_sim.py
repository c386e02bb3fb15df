"""A discrete-event simulation of the queue in front of a 4-slot backend, on a fake clock:
two tenants of one tier, one sending 5x more than the other."""

from __future__ import annotations

import heapq
import random

from proxy.admission import AdmissionQueue, QueuedRequest, TierLimits
from proxy.policies.build import default_queue_policies


def _jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def _simulate(heavy_rate: float, light_rate: float, seconds: float, slots: int = 4,
              tokens_per_s: float = 400.0, seed: int = 7) -> dict[str, object]:
    rng = random.Random(seed)
    q = AdmissionQueue({"normal": TierLimits(1.0, 10**6, 10**6)},
                       default_queue_policies(aging_s=60, reference_tokens=8192))
    arrivals: list[tuple[float, str]] = []
    for tenant, rate in (("heavy", heavy_rate), ("light", light_rate)):
        t = 0.0
        while t < seconds:
            t += rng.expovariate(rate)
            arrivals.append((t, tenant))
    arrivals.sort()
    busy: list[float] = []  # end times of running requests
    waits: dict[str, list[float]] = {"heavy": [], "light": []}
    served_log: list[tuple[str, float]] = []
    now = 0.0
    i = 0
    while i < len(arrivals) or len(q) or busy:
        next_arrival = arrivals[i][0] if i < len(arrivals) else float("inf")
        next_done = busy[0] if busy else float("inf")
        now = min(next_arrival, next_done)
        if now == next_done:
            heapq.heappop(busy)
        else:
            tenant = arrivals[i][1]
            q.push(QueuedRequest("normal", tenant, prompt_tokens=60, expected_output=40,
                                 arrival_s=now), now)
            i += 1
        while len(busy) < slots and (req := q.pop()) is not None:
            waits[req.tenant].append(now - req.arrival_s)
            served_log.append((req.tenant, req.cost))
            heapq.heappush(busy, now + (req.prompt_tokens + req.expected_output) / tokens_per_s)
    return {"waits": waits, "served": served_log}


def test_backlogged_tenants_get_equal_weighted_token_service_per_window() -> None:
    # Capacity: 4 slots / 0.25 s = 16 req/s. Offered: heavy 100/s + light 20/s: both stay
    # backlogged (the light one still sends more than its fair 8/s).
    result = _simulate(heavy_rate=100, light_rate=20, seconds=60)
    served = result["served"]
    assert isinstance(served, list)
    window = 100
    # Per window of 100 dispatches while both are sending:
    for start in range(0, 900, window):  # 16 req/s: the first ~56 s, while both send
        chunk = served[start:start + window]
        per = {"heavy": 0.0, "light": 0.0}
        for tenant, cost in chunk:
            per[tenant] += cost
        assert _jain(list(per.values())) >= 0.95, (start, per)


def test_light_tenant_wait_stays_near_unloaded_under_a_heavy_flood() -> None:
    # Light sends 2/s (well under its fair share): alone, it barely waits.
    alone = _simulate(heavy_rate=1e-9, light_rate=2, seconds=60)
    flooded = _simulate(heavy_rate=80, light_rate=2, seconds=60)
    waits_alone = alone["waits"]["light"]  # type: ignore[index]
    waits_flooded = flooded["waits"]["light"]  # type: ignore[index]
    mean_alone = sum(waits_alone) / len(waits_alone)
    mean_flooded = sum(waits_flooded) / len(waits_flooded)
    heavy_waits = flooded["waits"]["heavy"]  # type: ignore[index]
    # The heavy tenant queues for seconds; the light one waits at most about one service time.
    assert sum(heavy_waits) / len(heavy_waits) > 5.0
    assert mean_flooded < mean_alone + 0.25, (mean_alone, mean_flooded)
