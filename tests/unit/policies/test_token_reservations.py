"""Which backend drains for a request its token budget does not fit: the plain policy, alone."""

from __future__ import annotations

from proxy.policies.token_reservations import TokenReservations
from proxy.policies.types import QueuedRequest, State

A, B = "http://a:1", "http://b:1"


def _req(tier: str = "low", tenant: str = "t") -> QueuedRequest:
    return QueuedRequest(tier=tier, tenant=tenant, prompt_tokens=1, expected_output=1, arrival_s=0)


def test_the_backend_with_the_fewest_tokens_in_flight_drains_for_it() -> None:
    holds = TokenReservations({"high": 0, "low": 1})
    big = _req()
    assert holds.reserve(big, {A: 900.0, B: 400.0}) == B
    assert holds.holder(B) is big and holds.holder(A) is None
    assert holds.admits(B, big) and holds.admits(A, _req())
    assert not holds.admits(B, _req()) and not holds.admits(B, None)
    assert holds.admits(B, _req("high"))  # a strictly better tier passes


def test_one_hold_a_request_and_a_better_tier_takes_it_over() -> None:
    holds = TokenReservations({"high": 0, "low": 1})
    big, other = _req(), _req(tenant="u")
    assert holds.reserve(big, {A: 100.0, B: 200.0}) == A
    assert holds.reserve(big, {A: 500.0, B: 200.0}) == A  # it keeps the one it holds
    assert holds.reserve(other, {A: 100.0}) is None  # held: the same tier waits its turn
    assert holds.reserve(other, {A: 100.0, B: 200.0}) == B
    urgent = _req("high", tenant="chat")
    assert holds.reserve(urgent, {A: 100.0}) == A and holds.holder(A) is urgent


def test_a_hold_moves_with_the_backends_it_can_use_and_ends_with_the_queue() -> None:
    holds = TokenReservations()
    big = _req()
    holds.reserve(big, {A: 0.0})
    assert holds.reserve(big, {B: 0.0}) == B and holds.holder(A) is None  # A ejected, say
    big.state = State.EXPIRED
    assert holds.holder(B) is None and holds.held() == {}
    again = _req(tenant="u")
    holds.reserve(again, {A: 0.0})
    holds.release(again)  # sent
    assert holds.held() == {}
    holds.reserve(again, {A: 0.0})
    holds.forget([A])  # the backend left the configuration
    assert holds.holder(A) is None


def test_a_tenant_holds_one_backend_at_most() -> None:
    holds = TokenReservations()
    first, second = _req(tenant="batch"), _req(tenant="batch")
    assert holds.reserve(first, {A: 0.0, B: 0.0}) == A
    assert holds.reserve(second, {B: 0.0}) is None  # B stays free for every other tenant
    assert holds.reserve(_req(tenant="other"), {B: 0.0}) == B


def test_a_tier_a_reload_removed_ranks_worst() -> None:
    """It ranked as the best: its hold held the high tier back (red team F3, stop 51)."""
    holds = TokenReservations({"high": 0, "normal": 5})
    gone = _req("batch", tenant="b")
    holds.reserve(gone, {A: 0.0})
    assert holds.admits(A, _req("high", tenant="h")) and holds.admits(A, _req("normal"))


def test_a_hold_lasts_while_its_request_is_next() -> None:
    ahead: set[int] = set()
    holds = TokenReservations(is_next=lambda req: id(req) not in ahead)
    big = _req()
    holds.reserve(big, {A: 0.0})
    ahead.add(id(big))  # a shorter request of its tenant went ahead of it
    assert holds.holder(A) is None and holds.admits(A, _req(tenant="v"))
