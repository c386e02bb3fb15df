"""Per-pick cost of ``backends: kv_aware`` by the number of tenants active lately, in µs, p50 /
p99: a conversation's turn (its history at home), and a tenant's first prompt under a preamble
other tenants of its cache group sent (the new-placement rule reads where every tenant lives).
Each pick runs on the proxy's event loop: its cost delays every other request.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_pick_cost.py [--tenants 100 2000 20000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from proxy.bench.kvviews import IndexedBackend
from proxy.config.backends import Backend
from proxy.policies.backends import Candidate
from proxy.policies.kvaware import KvAware
from proxy.policies.kvterms import latency_weights
from proxy.policies.types import QueuedRequest

BLOCK = 16
WEIGHTS = latency_weights({"high": 0, "normal": 1, "low": 2}, best=0.5, worst=0.1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request(tenant: str, blocks: Sequence[int]) -> QueuedRequest:
    req = QueuedRequest(
        "normal", tenant, BLOCK * len(blocks) + 8, expected_output=16, arrival_s=0.0
    )
    req.prompt_blocks = tuple(blocks)
    return req


def measure(tenants: int, picks: int, rng: random.Random) -> dict[str, list[float]]:
    clock = Clock()
    indexes: list[set[int]] = [set() for _ in range(4)]
    views = [
        IndexedBackend(Backend(url=f"http://b{i}:80"), cached=ix) for i, ix in enumerate(indexes)
    ]
    chooser = KvAware(block_size=BLOCK, latency_weights=WEIGHTS, clock=clock)
    preamble = [rng.getrandbits(63) for _ in range(40)]
    for t in range(tenants):  # each tenant's first conversation, sent and run: it lives there
        view = views[t % 3]  # the fourth backend: no tenant lives there
        blocks = [*preamble, *(rng.getrandbits(63) for _ in range(20))]
        req = request(f"t{t}", blocks)
        chooser.served(view, req)
        chooser.ended(view, req, ran=True)
        indexes[t % 3].update(blocks)
        clock.now += 0.001
    candidates = [Candidate(v, v.max_room, None) for v in views]
    out: dict[str, list[float]] = {"turn": [], "first prompt under a shared preamble": []}
    for i in range(picks):
        turn = request(f"t{i % tenants}", [*preamble, *(rng.getrandbits(63) for _ in range(30))])
        first = request(f"new{i}", [*preamble, rng.getrandbits(63)])
        for kind, req in (("turn", turn), ("first prompt under a shared preamble", first)):
            start = time.perf_counter()
            chooser.pick(candidates, req)
            out[kind].append((time.perf_counter() - start) * 1e6)
        clock.now += 0.001
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[100, 2_000, 20_000])
    parser.add_argument("--picks", type=int, default=2_000)
    args = parser.parse_args()
    rng = random.Random(7)
    print("| tenants active lately | pick | p50 µs | p99 µs |")
    print("|---|---|---|---|")
    for n in args.tenants:
        for kind, times in measure(n, args.picks, rng).items():
            times.sort()
            p99 = times[int(0.99 * (len(times) - 1))]
            print(f"| {n:,} | {kind} | {statistics.median(times):.0f} | {p99:.0f} |")


if __name__ == "__main__":
    main()
