"""The tenant counting the most (proxy.policies.kvlargest), against the scan it replaced: the
first of an insertion-ordered dict's maximal counts, a tenant at 0 dropped and re-added last."""

from __future__ import annotations

import random

import pytest

from proxy.policies.kvlargest import Largest


def _scan(counts: dict[str, int]) -> str | None:
    return max(counts, key=lambda t: counts[t]) if counts else None


@pytest.mark.parametrize("seed", range(6))
def test_largest_is_the_scans_choice_through_random_adds_and_removes(seed: int) -> None:
    rng = random.Random(seed)
    largest, counts = Largest(), dict[str, int]()
    tenants = [f"t{i}" for i in range(rng.choice((3, 12, 60)))]
    for _ in range(20_000):
        tenant = rng.choice(tenants)
        if rng.random() < 0.5 or tenant not in counts:
            largest.add(tenant)
            counts[tenant] = counts.get(tenant, 0) + 1
        elif rng.random() < 0.5:  # the scan's choice loses one (the memory's eviction)
            top = _scan(counts)
            assert top is not None and largest.largest() == top
            largest.remove(top)
            counts[top] -= 1
            if not counts[top]:
                del counts[top]
        else:
            largest.remove(tenant)
            counts[tenant] -= 1
            if not counts[tenant]:
                del counts[tenant]
        assert largest.largest() == _scan(counts)
        assert largest.count(tenant) == counts.get(tenant, 0)


def test_stale_entries_are_rebuilt_away_so_the_structure_stays_bounded() -> None:
    largest = Largest()
    for _ in range(50_000):
        largest.add("a")
        largest.remove("a")
        largest.add("b")
    assert largest._entries <= 2 * 2 + 1024 + 1
    assert largest.largest() == "b"
