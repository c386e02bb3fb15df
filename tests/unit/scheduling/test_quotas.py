"""Quotas per UTC day and calendar month on the wall clock (proxy.scheduling.quotas): reserve
the worst case, refuse past the limit with a Retry-After to the reset, settle to the real
usage in the period the request was admitted in; a fake wall clock crosses midnight and the
year's last month."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from proxy.scheduling.quotas import QuotaAsk, QuotaLedger, period
from tests.helpers.clock import FakeClock


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def ask(tokens: float, cost: float = 0.0, **limits: float) -> QuotaAsk:
    return QuotaAsk("acme", limits, tokens, cost)


def test_periods_are_utc_days_and_calendar_months() -> None:
    assert period("day", at("2026-12-31T23:59:59")) == ("2026-12-31", at("2027-01-01T00:00:00"))
    assert period("day", at("2027-01-01T00:00:00")) == ("2027-01-01", at("2027-01-02T00:00:00"))
    assert period("month", at("2026-12-31T23:59:59")) == ("2026-12", at("2027-01-01T00:00:00"))
    assert period("month", at("2027-02-10T12:00:00")) == ("2027-02", at("2027-03-01T00:00:00"))
    assert period("month", at("2028-02-29T00:00:00"))[1] == at("2028-03-01T00:00:00")


async def test_a_daily_quota_refuses_until_midnight_then_starts_again() -> None:
    wall = FakeClock(at("2026-12-01T23:00:00"))
    ledger = QuotaLedger()
    first = await ledger.reserve(ask(600, tokens_per_day=1000), wall())
    assert first.allowed and first.hold is not None
    refused = await ledger.reserve(ask(500, tokens_per_day=1000), wall())
    assert not refused.allowed and refused.which == "tokens_per_day"
    assert (refused.limit, refused.used, refused.asked) == (1000, 600, 500)
    assert refused.retry_after_s == pytest.approx(3600.0)  # to 00:00 UTC
    # It used 100 of its 600: 500 come back and the same request fits now.
    ledger.settle(first.hold, 100.0, None)
    assert (await ledger.reserve(ask(500, tokens_per_day=1000), wall())).allowed
    assert not (await ledger.reserve(ask(401, tokens_per_day=1000), wall())).allowed
    wall.advance(3600)  # midnight: a new day's quota
    assert (await ledger.reserve(ask(1000, tokens_per_day=1000), wall())).allowed
    usage = ledger.usage("acme", {"tokens_per_day": 1000}, wall())
    assert usage["tokens_per_day"]["used"] == 1000
    assert usage["tokens_per_day"]["period"] == "2026-12-02"
    assert usage["tokens_per_day"]["resets_in_s"] == 86400.0


async def test_a_monthly_quota_spans_days_and_resets_with_the_month() -> None:
    wall = FakeClock(at("2026-12-30T10:00:00"))
    ledger = QuotaLedger()
    limits = {"tokens_per_day": 1000.0, "tokens_per_month": 1500.0}
    assert (await ledger.reserve(QuotaAsk("acme", limits, 900, 0), wall())).allowed
    wall.advance(86400)  # the 31st: a new day, the same month
    refused = await ledger.reserve(QuotaAsk("acme", limits, 900, 0), wall())
    assert not refused.allowed and refused.which == "tokens_per_month"
    # The month ends at the next midnight, as the day does: 14 h either way.
    assert refused.retry_after_s == pytest.approx(14 * 3600)
    assert (await ledger.reserve(QuotaAsk("acme", limits, 600, 0), wall())).allowed
    wall.advance(14 * 3600)  # 2027-01-01 00:00 UTC: both start again
    assert (await ledger.reserve(QuotaAsk("acme", limits, 1000, 0), wall())).allowed


async def test_the_refusal_names_the_quota_that_frees_last() -> None:
    wall = FakeClock(at("2026-12-10T12:00:00"))
    ledger = QuotaLedger()
    limits = {"tokens_per_day": 100.0, "tokens_per_month": 100.0}
    assert (await ledger.reserve(QuotaAsk("acme", limits, 100, 0), wall())).allowed
    refused = await ledger.reserve(QuotaAsk("acme", limits, 1, 0), wall())
    assert refused.which == "tokens_per_month"  # both full: waiting for the day is not enough
    assert refused.retry_after_s == pytest.approx(at("2027-01-01T00:00:00") - wall())


async def test_a_request_settled_after_midnight_corrects_its_own_day() -> None:
    wall = FakeClock(at("2026-12-01T23:59:00"))
    ledger = QuotaLedger()
    late = await ledger.reserve(ask(800, tokens_per_day=1000), wall())
    assert late.hold is not None
    wall.advance(120)  # it ends at 00:01 having used 900: yesterday's business
    ledger.settle(late.hold, 900.0, None)
    today = ledger.usage("acme", {"tokens_per_day": 1000}, wall())["tokens_per_day"]
    assert today["used"] == 0 and today["period"] == "2026-12-02"


async def test_budget_counts_money_and_refusal_is_all_or_nothing() -> None:
    wall = FakeClock(at("2026-12-01T08:00:00"))
    ledger = QuotaLedger()
    limits = {"tokens_per_day": 10_000.0, "budget_per_day": 1.0}
    first = await ledger.reserve(QuotaAsk("acme", limits, 1000, 0.75), wall())
    assert first.allowed and first.hold is not None
    refused = await ledger.reserve(QuotaAsk("acme", limits, 1000, 0.5), wall())
    assert not refused.allowed and refused.which == "budget_per_day"
    # Nothing taken from the token quota by the refused request.
    assert ledger.usage("acme", limits, wall())["tokens_per_day"]["used"] == 1000
    ledger.settle(first.hold, 400.0, 0.25)  # it cost 0.25, not the 0.75 reserved
    assert (await ledger.reserve(QuotaAsk("acme", limits, 1000, 0.5), wall())).allowed
    used = ledger.usage("acme", limits, wall())
    assert used["budget_per_day"]["used"] == pytest.approx(0.75)
    assert used["tokens_per_day"]["used"] == 1400


async def test_unknown_usage_keeps_the_reservation_and_tenants_are_apart() -> None:
    wall = FakeClock(at("2026-12-01T08:00:00"))
    ledger = QuotaLedger()
    held = await ledger.reserve(ask(700, tokens_per_day=1000), wall())
    assert held.hold is not None
    ledger.settle(held.hold, None, None)
    assert not (await ledger.reserve(ask(301, tokens_per_day=1000), wall())).allowed
    other = QuotaAsk("other", {"tokens_per_day": 1000}, 1000, 0)
    assert (await ledger.reserve(other, wall())).allowed
