"""``still_covered``: a tenant's waiting reservations decided again, in queue order, when a reload
changes its quota (proxy.scheduling.quotas; red team F3 of rt4). A plain function of the holds,
the new limits, the counters and a wall clock given: no sleep, no clock read."""

from __future__ import annotations

from datetime import UTC, datetime

from proxy.scheduling.quotas import QuotaHold, period, still_covered

WALL = datetime(2026, 12, 1, 18, tzinfo=UTC).timestamp()  # 6 h before the day's reset
TODAY = period("day", WALL)[0]
YESTERDAY = period("day", WALL - 86400)[0]
MONTH = period("month", WALL)[0]


def hold(tokens: float, cost: float = 0.0, day: str = TODAY) -> QuotaHold:
    periods = (("tokens_per_day", day), ("budget_per_month", MONTH))
    return QuotaHold("acme", periods, tokens, cost)


def test_the_earliest_stay_while_the_new_limit_covers_them() -> None:
    # One request running (1,010 reserved) and five queued of 1,010 each: 6,060 used.
    queued = [hold(1010) for _ in range(5)]
    verdicts = still_covered(queued, {"tokens_per_day": 3500}, {"tokens_per_day": 6060}, WALL)
    assert [v.allowed for v in verdicts] == [True, True, False, False, False]
    first_refused = verdicts[2]
    # As at admission: the counter, its limit, the use without it (the running one and the two
    # kept), what it asks, the wait to the day's reset.
    assert (first_refused.which, first_refused.limit) == ("tokens_per_day", 3500)
    assert (first_refused.used, first_refused.asked) == (3030, 1010)
    assert first_refused.retry_after_s == 6 * 3600
    assert all(v.hold is None for v in verdicts[2:])


def test_a_smaller_one_later_in_the_queue_still_fits_after_a_refusal() -> None:
    queued = [hold(1000), hold(3000), hold(500)]
    verdicts = still_covered(queued, {"tokens_per_day": 2000}, {"tokens_per_day": 4500}, WALL)
    assert [v.allowed for v in verdicts] == [True, False, True]


def test_a_raised_limit_keeps_every_one() -> None:
    queued = [hold(1000) for _ in range(4)]
    verdicts = still_covered(queued, {"tokens_per_day": 10_000}, {"tokens_per_day": 4000}, WALL)
    assert all(v.allowed for v in verdicts)


def test_a_reservation_of_a_period_over_is_not_taken_off_todays_use() -> None:
    # Reserved yesterday (before midnight): today's counter never held it.
    queued = [hold(1000, day=YESTERDAY), hold(1000)]
    verdicts = still_covered(queued, {"tokens_per_day": 1500}, {"tokens_per_day": 1000}, WALL)
    assert [v.allowed for v in verdicts] == [True, False]
    assert verdicts[1].used == 1000


def test_budgets_count_the_cost_and_every_counter_must_fit() -> None:
    limits = {"tokens_per_day": 100_000, "budget_per_month": 1.0}
    queued = [hold(100, cost=0.4), hold(100, cost=0.4), hold(100, cost=0.4)]
    used = {"tokens_per_day": 300, "budget_per_month": 1.3}  # 0.1 spent before them
    verdicts = still_covered(queued, limits, used, WALL)
    assert [v.allowed for v in verdicts] == [True, True, False]
    assert verdicts[2].which == "budget_per_month"


def test_a_counter_new_to_the_tenant_starts_from_its_use() -> None:
    # The reload adds a monthly token quota: the holds never charged it; nothing comes off.
    limits = {"tokens_per_month": 2500}
    queued = [hold(1000), hold(1000), hold(1000)]
    verdicts = still_covered(queued, limits, {"tokens_per_month": 0}, WALL)
    assert [v.allowed for v in verdicts] == [True, True, False]
