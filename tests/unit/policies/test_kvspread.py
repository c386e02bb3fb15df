"""kv_aware's recent shares (proxy.policies.kvspread): which backends are crowded, which of those
a tenant's own work crowds, and a memory bounded by the tenants active lately. An injected
clock, no sleep."""

from __future__ import annotations

import pytest

from proxy.policies.kvspread import SWEEP_EVERY, RecentShares
from tests.helpers.clock import FakeClock

A, B = "http://a:80", "http://b:80"


def test_a_crowded_backend_is_the_tenants_own_only_where_its_weight_covers_the_excess() -> None:
    clock = FakeClock()
    shares = RecentShares(max_share=0.64, tau_s=30.0, at_least=16, clock=clock)
    for _ in range(10):
        shares.sent(A, "victim", 8.0)
    for _ in range(40):
        shares.sent(A, "flood", 0.0)  # a prompt cached whole fills nothing: no vote
    assert shares.crowded(2) == frozenset()  # ten sends that weighed: too few to judge
    for _ in range(30):
        shares.sent(A, "flood", 1.0)
    for _ in range(10):
        shares.sent(B, "other", 8.0)
    # A: 110 of 190 (58 %): not crowded.
    assert shares.crowded(2) == frozenset() and shares.own_crowded("victim", 2) == frozenset()
    for _ in range(40):
        shares.sent(A, "flood", 1.0)
    # A: 150 of 230 (65 %), 2.8 past 64 %: the victim's 80 there could account for it.
    assert shares.crowded(2) == {A} and shares.crowded(1) == frozenset()
    assert shares.own_crowded("victim", 2) == {A} and shares.own_crowded("victim", 1) == set()
    assert shares.own_crowded("other", 2) == frozenset()
    assert shares.own_crowded(None, 2) == frozenset()
    for _ in range(300):
        shares.sent(A, "flood", 1.0)
    # A: 450 of 530, 111 past 64 %: the flood's work, more than the victim's 80.
    assert shares.own_crowded("victim", 2) == frozenset()
    assert shares.own_crowded("flood", 2) == {A}
    at = clock()
    clock.advance(1.0)
    for _ in range(370):
        shares.unsent(A, "flood", at, 1.0)  # the flood never ran: as if never sent
    assert shares.shares()[A] == pytest.approx(0.5) and shares.crowded(2) == frozenset()


def test_tenants_whose_counts_faded_are_forgotten() -> None:
    clock = FakeClock()
    shares = RecentShares(max_share=0.64, tau_s=1.0, at_least=16, clock=clock)
    for n in range(SWEEP_EVERY - 1):
        shares.sent(A, f"tenant-{n}")  # one request each, of many tenant names
    assert shares.tenants() == SWEEP_EVERY - 1
    clock.advance(60.0)  # sixty time constants: every count faded
    shares.sent(B, "last")
    assert shares.tenants() == 1


def test_a_tenant_lives_where_it_sent_half_its_weight_lately_and_a_spread_flood_lives_nowhere() -> (
    None
):
    clock = FakeClock()
    shares = RecentShares(max_share=0.64, tau_s=30.0, at_least=16, clock=clock)
    C = "http://c:80"
    shares.sent(A, "alice", 24.0)
    shares.sent(B, "alice", 8.0)  # 75 % on A: alice lives on A
    shares.sent(B, "bob", 16.0)
    shares.sent(C, "bob", 16.0)  # half on each: bob lives on both
    for url in (A, B, C):
        shares.sent(url, "flood", 50.0)  # a third on each: nowhere
    shares.sent(C, "stranger", 1.0)  # all of it on C, but one block: not a resident
    assert shares.residents(but=None) == {A: 1, B: 1, C: 1}
    assert shares.residents(but="bob") == {A: 1}  # who asks is not counted
    # A residency ends when the weight there fades under RESIDENT_BLOCKS: alice's 24 after
    # 30 * ln(3) = 33.0 s; bob's 16 after 30 * ln(2) = 20.8 s.
    clock.advance(20.5)
    assert shares.residents(but=None) == {A: 1, B: 1, C: 1}
    clock.advance(0.5)
    assert shares.residents(but=None) == {A: 1}
    clock.advance(12.0)
    assert shares.residents(but=None) == {}
    shares.sent(B, "alice", 40.0)  # she moved: she lives on B now, not on A
    assert shares.residents(but=None) == {B: 1}


def test_where_tenants_live_stays_bounded_however_often_they_send() -> None:
    clock = FakeClock()
    shares = RecentShares(max_share=0.64, tau_s=30.0, at_least=16, clock=clock)
    for i in range(30_000):
        shares.sent(A if i % 3 else B, f"t{i % 50}", 10.0)
        clock.advance(0.01)
    assert len(shares._residency._ends) <= 2 * 50 + 1024 + 1
    assert sum(shares.residents(but=None).values()) == 50
