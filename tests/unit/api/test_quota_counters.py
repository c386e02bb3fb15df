"""The quota counters are one table: every reader (the refusal, ``top``, the config, billing,
the docs) follows a row, so a new counter needs no edit to any of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.api import quota_counters
from proxy.api.quota_counters import COUNTERS, QuotaCounter
from proxy.api.quota_errors import quota_refused
from proxy.config.quotas import Quota
from proxy.ops.live.top import quota_text
from proxy.request.billing import affordable_output
from proxy.scheduling.quotas import QuotaAsk, QuotaHold

DOCS = Path(__file__).resolve().parents[3] / "docs" / "quotas.md"
WEEKLY = QuotaCounter("tokens_per_week", "tokens", "week", "quota_exceeded", "tok/wk")  # type: ignore[arg-type]


@pytest.fixture
def weekly(monkeypatch: pytest.MonkeyPatch) -> QuotaCounter:
    monkeypatch.setitem(quota_counters.COUNTERS, WEEKLY.name, WEEKLY)
    return WEEKLY


def test_a_new_counter_is_refused_with_its_own_period_and_code(weekly: QuotaCounter) -> None:
    err = quota_refused(weekly.name, 1000, 990, 50, 3600)
    assert "for this week (UTC)" in err.message
    assert "month" not in err.message and "budget" not in err.message
    assert err.code == "quota_exceeded"
    assert err.status == 429


def test_a_new_counter_shows_its_label_in_top(weekly: QuotaCounter) -> None:
    text = quota_text({weekly.name: {"used": 50.0, "limit": 100.0}}).plain
    assert text.startswith("tok/wk 50%")


def test_a_new_counter_is_charged_by_its_measure(weekly: QuotaCounter) -> None:
    ask = QuotaAsk("t", {weekly.name: 100.0}, tokens=7.0, cost=3.0)
    assert ask.amount(weekly.name) == 7.0
    hold = QuotaHold("t", ((weekly.name, "2026-W49"),), tokens=7.0, cost=3.0)
    assert hold.delta(weekly.name, tokens=9.0, cost=1.0) == 2.0


@pytest.mark.parametrize("counter", list(COUNTERS.values()), ids=lambda c: c.name)
def test_every_counter_is_read_from_the_table(counter: QuotaCounter) -> None:
    err = quota_refused(counter.name, 10.0, 9.0, 5.0, 60.0)
    assert err.code == counter.code
    assert f"this {counter.period_text}" in err.message
    assert ("budget" in err.message) == counter.money
    assert quota_text({counter.name: {"used": 1.0, "limit": 2.0}}).plain.startswith(counter.label)
    assert QuotaAsk("t", {}, tokens=1.0, cost=2.0).amount(counter.name) == (
        2.0 if counter.money else 1.0
    )


def test_the_config_has_a_field_for_each_counter_and_no_other() -> None:
    assert set(Quota.model_fields) == set(COUNTERS)


def test_a_cost_counter_without_a_price_leaves_the_output_unbounded() -> None:
    for counter in COUNTERS.values():
        room = affordable_output({counter.name: 100.0}, {}, prompt=10.0, price=None, sequences=1)
        assert (room is None) == counter.money


def test_the_docs_table_is_the_table() -> None:
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    assert rows == [
        f"| `{c.name}` | {c.measure} | {c.span} | `{c.code}` | `{c.label}` |"
        for c in COUNTERS.values()
    ]
