"""Cost of one push and one pop of the admission queue against the number of backlogged tenants.

    python benchmarks/queue_bench.py

One tier, default policies; every tenant holds two requests, then requests are pushed and
popped alternately (a push for the next tenant round-robin, a pop by policy), so the number of
backlogged tenants stays where it was set. Prints microseconds per operation: the mean over a
round of operations, the best of several rounds (the machine's noise only ever adds), each
round long enough to include the queue's periodic clean-up of stale heap entries.
"""

from __future__ import annotations

import time

from proxy.ops.runtime import tune_gc
from proxy.policies.types import QueuedRequest, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.queue import AdmissionQueue

_ROUNDS = 5


def measure(tenants: int, rounds: int = _ROUNDS) -> tuple[float, float]:
    """(push µs, pop µs) per operation with ``tenants`` backlogged tenants."""
    queue = AdmissionQueue({"t": TierLimits(1.0, 10**9, 1e12)}, default_queue_policies())
    names = [f"tenant-{i}" for i in range(tenants)]
    now = 0.0
    for _ in range(2):
        for name in names:
            now += 1e-4
            queue.push(QueuedRequest("t", name, 100, 50, now), now)
    # Every stale heap entry is dropped within about 2 x tenants operations.
    ops = max(20_000, 2 * tenants)
    best_push = best_pop = float("inf")
    clock = time.perf_counter_ns
    i = 0
    for _ in range(rounds):
        push_ns = pop_ns = 0
        for _ in range(ops):
            i += 1
            now += 1e-4
            req = QueuedRequest("t", names[i % tenants], 100 + i % 7, 50, now)
            start = clock()
            queue.push(req, now)
            middle = clock()
            popped = queue.pop()
            end = clock()
            assert popped is not None
            push_ns += middle - start
            pop_ns += end - middle
        best_push = min(best_push, push_ns / ops / 1000)
        best_pop = min(best_pop, pop_ns / ops / 1000)
    assert len(queue.backlogged_tenants("t")) >= tenants * 0.99
    return best_push, best_pop


def main() -> None:
    """Twice: under CPython's default garbage collector settings, then as `tierproxy serve`
    runs (``proxy.ops.runtime.tune_gc``), since full collections of a deep backlog cost more than
    the queue itself."""
    for label in ("CPython's default GC", "GC as tierproxy serve sets it"):
        if label.startswith("GC as"):
            tune_gc()
        print(label)
        print(f"{'backlogged tenants':>20} {'push µs':>9} {'pop µs':>9}")
        for tenants in (10, 1_000, 10_000, 100_000):
            push_us, pop_us = measure(tenants)
            print(f"{tenants:>20,} {push_us:>9.2f} {pop_us:>9.2f}")


if __name__ == "__main__":
    main()
