"""kv_aware's spread shares (proxy.policies.kvspread): which backends are crowded, which of those
a tenant's own requests crowd, and a memory bounded by the tenants active lately. An injected
clock, no sleep."""

from __future__ import annotations

from proxy.policies.kvspread import SWEEP_EVERY, RequestShares
from tests.helpers.clock import FakeClock

A, B = "http://a:80", "http://b:80"


def test_a_crowded_backend_is_the_tenants_own_only_where_its_requests_cover_the_excess() -> None:
    clock = FakeClock()
    shares = RequestShares(max_share=0.64, tau_s=30.0, at_least=16, clock=clock)
    for _ in range(10):
        shares.sent(A, "victim")
    assert shares.crowded(2) == frozenset()  # ten requests: too few to judge
    for _ in range(30):
        shares.sent(A, "flood")
    for _ in range(10):
        shares.sent(B, "other")
    # A: 40 of 50 (80 %), 8 past 64 %: the victim's 10 there could account for it.
    assert shares.crowded(2) == {A} and shares.crowded(1) == frozenset()
    assert shares.own_crowded("victim", frozenset({A})) == {A}
    assert shares.own_crowded("other", frozenset({A})) == frozenset()
    assert shares.own_crowded(None, frozenset({A})) == frozenset()
    for _ in range(40):
        shares.sent(A, "flood")
    # A: 80 of 90, 22 past 64 %: the flood's, not the victim's 10.
    assert shares.own_crowded("victim", frozenset({A})) == frozenset()
    assert shares.own_crowded("flood", frozenset({A})) == {A}
    at = clock()
    clock.advance(1.0)
    for _ in range(70):
        shares.unsent(A, "flood", at)  # the flood never ran: as if never sent
    assert shares.own_crowded("victim", frozenset({A})) == {A}


def test_tenants_whose_requests_faded_are_forgotten() -> None:
    clock = FakeClock()
    shares = RequestShares(max_share=0.64, tau_s=1.0, at_least=16, clock=clock)
    for n in range(SWEEP_EVERY - 1):
        shares.sent(A, f"tenant-{n}")  # one request each, of many tenant names
    assert shares.tenants() == SWEEP_EVERY - 1
    clock.advance(60.0)  # sixty time constants: every count faded
    shares.sent(B, "last")
    assert shares.tenants() == 1
