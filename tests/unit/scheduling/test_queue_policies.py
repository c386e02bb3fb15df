from collections import Counter
from dataclasses import replace

import pytest

from proxy.policies.order import short_first_key
from proxy.policies.tenants import VirtualTokenCounter
from proxy.policies.tiers import StrideTierSelector
from proxy.policies.types import QueuedRequest, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.queue import AdmissionQueue

DEFAULT_WEIGHTS = {"high": 10.0, "normal": 5.0, "low": 1.0}


def _queue(weights: dict[str, float] = DEFAULT_WEIGHTS, aging_s: float = 30.0) -> AdmissionQueue:
    tiers = {
        t: TierLimits(weight=w, max_queue=100_000, queue_timeout_s=1e9) for t, w in weights.items()
    }
    return AdmissionQueue(tiers, default_queue_policies(aging_s=aging_s, reference_tokens=8192))


def _req(
    tier: str, tenant: str = "t", arrival: float = 0.0, prompt: int = 10, out: int = 10
) -> QueuedRequest:
    return QueuedRequest(
        tier=tier, tenant=tenant, prompt_tokens=prompt, expected_output=out, arrival_s=arrival
    )


def test_weights_honoured_over_10000_dequeues() -> None:
    q = _queue()
    for tier in DEFAULT_WEIGHTS:
        for i in range(12_000):
            q.push(_req(tier, arrival=i * 1e-3), now=0.0)
    picks = Counter(q.pop().tier for _ in range(10_000))  # type: ignore[union-attr]
    total = sum(DEFAULT_WEIGHTS.values())
    for tier, weight in DEFAULT_WEIGHTS.items():
        assert picks[tier] / 10_000 == pytest.approx(weight / total, rel=0.02)
    # The classic 2 : 1 : 1/5 ratio.
    assert picks["high"] / picks["normal"] == pytest.approx(2.0, rel=0.02)
    assert picks["normal"] / picks["low"] == pytest.approx(5.0, rel=0.02)


def test_work_conserving_empty_tiers_are_skipped() -> None:
    q = _queue()
    for i in range(50):
        q.push(_req("low", arrival=i), now=0.0)
    popped = [q.pop() for _ in range(50)]
    assert all(r is not None and r.tier == "low" for r in popped)
    assert q.pop() is None


def test_idle_tier_banks_no_credit() -> None:
    """A tier that was idle while others ran does not get a burst of catch-up picks."""
    q = _queue({"a": 1.0, "b": 1.0})
    for i in range(1000):
        q.push(_req("a", arrival=i), now=0.0)
    for _ in range(500):
        q.pop()
    for i in range(100):
        q.push(_req("b", arrival=1000 + i), now=0.0)
    first_20 = Counter(q.pop().tier for _ in range(20))  # type: ignore[union-attr]
    assert abs(first_20["a"] - first_20["b"]) <= 2


def test_short_first_inside_a_tenant() -> None:
    q = _queue()
    q.push(_req("high", arrival=0.0, prompt=6000, out=500), now=0.0)
    for i in range(5):
        q.push(_req("high", arrival=0.1 + i * 0.01, prompt=20, out=20), now=0.1)
    order = [q.pop().prompt_tokens for _ in range(6)]  # type: ignore[union-attr]
    assert order == [20, 20, 20, 20, 20, 6000]


def test_aging_bound_long_request_is_not_overtaken_by_later_arrivals() -> None:
    """A request is never overtaken by one that arrived aging_s or more after it."""
    aging = 30.0
    q = _queue(aging_s=aging)
    long = _req("high", arrival=0.0, prompt=100_000, out=2000)  # cost term saturates at 1
    q.push(long, now=0.0)
    # A steady flood of short requests, some arriving before the bound, some after.
    for i in range(1, 400):
        q.push(_req("high", arrival=i * 0.1, prompt=5, out=5), now=i * 0.1)
    order = []
    while (r := q.pop()) is not None:
        order.append(r)
    pos = order.index(long)
    overtaken_by = order[:pos]
    assert overtaken_by, "short requests that arrived shortly after should go first"
    assert all(r.arrival_s < aging for r in overtaken_by)
    assert any(r.arrival_s >= aging for r in order[pos + 1 :])


def test_short_first_key_is_time_independent_and_bounded() -> None:
    k_long_early = short_first_key(10**9, 0.0, reference_tokens=8192, aging_s=10)
    k_short_late = short_first_key(0, 10.0, reference_tokens=8192, aging_s=10)
    assert k_long_early <= k_short_late


def test_vtc_shares_weighted_tokens_between_heavy_and_light_tenant() -> None:
    """Two backlogged tenants in one tier: equal weighted-token service, even when one sends
    far more (and bigger) requests."""
    q = _queue({"normal": 1.0})
    for i in range(5000):
        q.push(_req("normal", "heavy", arrival=i, prompt=100, out=50), now=0.0)
    for i in range(1000):
        q.push(_req("normal", "light", arrival=i, prompt=40, out=20), now=0.0)
    served: dict[str, float] = {}
    for _ in range(800):
        r = q.pop()
        assert r is not None
        served[r.tenant] = served.get(r.tenant, 0.0) + r.cost
    jain = (sum(served.values()) ** 2) / (2 * sum(v * v for v in served.values()))
    assert jain >= 0.99


def test_vtc_returning_tenant_starts_at_backlogged_minimum() -> None:
    vtc = VirtualTokenCounter()
    q = AdmissionQueue(
        {"n": TierLimits(1.0, 100, 1e9)}, replace(default_queue_policies(), tenants=vtc)
    )
    q.push(_req("n", "busy", arrival=0.0), now=0.0)
    vtc.charge("busy", 10_000)
    q.push(_req("n", "back", arrival=1.0), now=1.0)
    assert vtc.counter("back") == 10_000
    # The tie goes to the one waiting longest, and it then alternates instead of monopolising.
    q.push(_req("n", "busy", arrival=2.0), now=2.0)
    q.push(_req("n", "back", arrival=3.0), now=3.0)
    assert [q.pop().tenant for _ in range(4)] == ["busy", "back", "busy", "back"]  # type: ignore[union-attr]


def test_vtc_respects_tenant_weight() -> None:
    q = _queue({"n": 1.0})
    for i in range(3000):
        q.push(QueuedRequest("n", "gold", 10, 10, float(i), tenant_weight=3.0), now=0.0)
        q.push(QueuedRequest("n", "std", 10, 10, float(i), tenant_weight=1.0), now=0.0)
    served = Counter(q.pop().tenant for _ in range(2000))  # type: ignore[union-attr]
    assert served["gold"] / served["std"] == pytest.approx(3.0, rel=0.02)


def test_tier_selector_rejects_bad_weights() -> None:
    with pytest.raises(ValueError):
        StrideTierSelector().set_tiers(
            {"x": TierLimits(weight=0.0, max_queue=1, queue_timeout_s=1)}
        )


def test_correct_charge_replaces_estimate() -> None:
    vtc = VirtualTokenCounter()
    q = AdmissionQueue(
        {"n": TierLimits(1.0, 100, 1e9)}, replace(default_queue_policies(), tenants=vtc)
    )
    r = _req("n", "a", prompt=100, out=100)  # estimate 300 weighted tokens
    q.push(r, now=0.0)
    assert q.pop() is r
    assert vtc.counter("a") == pytest.approx(300)
    q.correct_charge(r, 110)  # it really used 100 prompt + 5 output
    assert vtc.counter("a") == pytest.approx(110)


def test_a_retried_request_is_charged_once_whatever_its_dispatches() -> None:
    """Fresh eyes, 2026-12-06: a request retried after its backend failed before its first
    byte was charged its estimate at each dispatch and corrected once (+111 against +65)."""
    vtc = VirtualTokenCounter()
    q = AdmissionQueue(
        {"n": TierLimits(1.0, 100, 1e9)}, replace(default_queue_policies(), tenants=vtc)
    )
    r = _req("n", "a", prompt=100, out=100)  # estimate 300 weighted tokens
    q.push(r, now=0.0)
    assert q.pop() is r
    q.push(r, now=1.0, force=True)  # the retry: queued again (as the pipeline does), dispatched
    assert q.pop() is r
    assert vtc.counter("a") == pytest.approx(600)
    q.correct_charge(r, 110)
    assert vtc.counter("a") == pytest.approx(110)
    q.correct_charge(r, 0.0)  # a later correction replaces the last
    assert vtc.counter("a") == pytest.approx(0)
