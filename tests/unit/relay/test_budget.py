"""The memory budget's arithmetic."""

from __future__ import annotations

from proxy.relay.budget import HELD_PER_BODY_BYTE, MemoryBudget, held_estimate


def test_reservations_stay_within_the_limit_and_come_back() -> None:
    budget = MemoryBudget(100)
    first = budget.try_reserve(60)
    assert first is not None
    assert budget.try_reserve(41) is None  # 101 > 100: refused, nothing taken
    assert budget.held == 60
    second = budget.try_reserve(40)
    assert second is not None and budget.held == 100
    first.release()
    first.release()  # idempotent: a double release must not free someone else's bytes
    assert budget.held == 40
    second.release()
    assert budget.held == 0


def test_a_request_bigger_than_the_budget_passes_alone() -> None:
    budget = MemoryBudget(100)
    big = budget.try_reserve(500)
    assert big is not None
    assert budget.try_reserve(1) is None
    big.release()
    assert budget.try_reserve(1) is not None


def test_no_limit_never_refuses() -> None:
    budget = MemoryBudget(None)
    assert all(budget.try_reserve(10**12) is not None for _ in range(3))
    assert budget.held == 3 * 10**12


def test_the_estimate_is_the_measured_upper_bound() -> None:
    assert held_estimate(1000) == 1000 * HELD_PER_BODY_BYTE


def test_a_reservation_grows_within_the_limit_or_not_at_all() -> None:
    budget = MemoryBudget(100)
    upload = budget.try_reserve(0)
    other = budget.try_reserve(30)
    assert upload is not None and other is not None
    assert upload.grow(70) and budget.held == 100
    assert not upload.grow(1) and upload.amount == 70 and budget.held == 100
    other.release()
    assert upload.grow(200)  # alone in the budget: it may pass it (no request refused forever)
    upload.release()
    assert budget.held == 0
    assert not upload.grow(1) and budget.held == 0  # released: grows nothing


def test_a_spare_reservation_takes_only_the_budgets_first_half() -> None:
    budget = MemoryBudget(100)
    body = budget.try_reserve(30)
    assert body is not None
    spare = budget.try_reserve_spare(20)
    assert spare is not None and budget.held == 50
    assert budget.try_reserve_spare(1) is None  # 51 > half: the requests keep theirs
    assert budget.try_reserve(50) is not None  # a request's own bytes still fit the whole
    spare.release()
    assert budget.held == 80
    assert MemoryBudget(None).try_reserve_spare(10**12) is not None
