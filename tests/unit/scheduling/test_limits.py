import pytest

from proxy.config.tenants import Tenant
from proxy.scheduling.limits import LimitRegistry, TokenBucket


def _tenant(**limits: object) -> Tenant:
    return Tenant(name="t", tier="low", keys=[{"sha256": "0" * 64}], **limits)


def _simulate(registry: LimitRegistry, per_second: float, seconds: float, tokens: float = 1) -> int:
    """Offer requests at a steady rate on a fake clock; count the admitted ones."""
    admitted, t, step = 0, 0.0, 1.0 / per_second
    while t < seconds:
        if registry.try_admit("t", tokens, t).allowed:
            admitted += 1
            registry.settle("t", tokens, tokens, t)
        t += step
    return admitted


@pytest.mark.parametrize("rpm", [30, 120, 600])
def test_rpm_admits_the_configured_rate_over_a_simulated_minute(rpm: int) -> None:
    reg = LimitRegistry()
    reg.configure([_tenant(requests_per_minute=rpm)], now=0.0)
    # Start with the burst spent, then offer 5x the rate for a minute.
    for _ in range(rpm):
        reg.try_admit("t", 1, 0.0)
        reg.settle("t", 1, 1, 0.0)
    admitted = _simulate(reg, per_second=5 * rpm / 60, seconds=60.0)
    assert admitted == pytest.approx(rpm, rel=0.05)


def test_tpm_reserves_up_front_and_refunds_unused() -> None:
    reg = LimitRegistry()
    reg.configure([_tenant(tokens_per_minute=1200)], now=0.0)
    assert reg.try_admit("t", 1000, 0.0).allowed
    verdict = reg.try_admit("t", 1000, 0.0)
    assert not verdict.allowed and verdict.limit == "tokens_per_minute"
    # 800 more tokens needed at 20 tokens/s: exactly 40 s.
    assert verdict.retry_after_s == pytest.approx(40.0)
    reg.settle("t", 1000, 100, 0.0)  # it really used 100: 900 come back
    assert reg.try_admit("t", 1000, 0.0).allowed


def test_retry_after_is_accurate() -> None:
    reg = LimitRegistry()
    reg.configure([_tenant(requests_per_minute=6)], now=0.0)
    for _ in range(6):
        assert reg.try_admit("t", 1, 0.0).allowed
    verdict = reg.try_admit("t", 1, 0.0)
    assert verdict.retry_after_s == pytest.approx(10.0)
    assert not reg.try_admit("t", 1, 9.9).allowed
    assert reg.try_admit("t", 1, 10.0).allowed


def test_max_concurrent_and_refused_requests_take_nothing() -> None:
    reg = LimitRegistry()
    reg.configure([_tenant(max_concurrent=2, requests_per_minute=100)], now=0.0)
    assert reg.try_admit("t", 1, 0).allowed and reg.try_admit("t", 1, 0).allowed
    refused = reg.try_admit("t", 1, 0)
    assert not refused.allowed and refused.limit == "max_concurrent"
    assert reg.concurrent("t") == 2
    reg.settle("t", 1, None, 0)
    assert reg.try_admit("t", 1, 0).allowed


def test_oversize_request_waits_for_a_full_bucket_then_goes() -> None:
    bucket = TokenBucket(rate_per_s=10, capacity=100, now=0)
    bucket.take(100, 0)
    assert bucket.wait_for(500, 0) == pytest.approx(10.0)
    bucket.take(500, 10)  # goes into debt, capped at one bucket (a minute of the limit)
    assert bucket.wait_for(1, 10) == pytest.approx(10.1)


@pytest.mark.parametrize("used", [2_000, 10**9])
def test_overage_debt_is_capped_at_one_minute_of_the_limit(used: int) -> None:
    reg = LimitRegistry()
    reg.configure([_tenant(tokens_per_minute=600)], now=0.0)
    assert reg.try_admit("t", 100, 0.0).allowed
    reg.settle("t", 100, used, 0.0)  # far past its reservation
    verdict = reg.try_admit("t", 100, 0.0)
    # At most 600 tokens of debt at 10 tokens/s: 60 s to pay off, 10 s more for the 100 asked.
    assert not verdict.allowed and verdict.retry_after_s == pytest.approx(70.0)
    assert not reg.try_admit("t", 100, 69.9).allowed
    assert reg.try_admit("t", 100, 70.1).allowed


def test_reload_keeps_levels_and_drops_unlimited_tenants() -> None:
    reg = LimitRegistry()
    reg.configure([_tenant(requests_per_minute=60)], now=0.0)
    for _ in range(60):
        reg.try_admit("t", 1, 0.0)
    reg.configure([_tenant(requests_per_minute=30)], now=0.0)
    assert not reg.try_admit("t", 1, 0.0).allowed  # the spent allowance carried over
    reg.configure([_tenant()], now=0.0)
    assert reg.try_admit("t", 1, 0.0).allowed
    reg.configure([], now=0.0)
    assert reg.try_admit("gone", 1, 0.0).allowed


def test_usage_past_the_reservation_is_debited_and_delays_the_next_request() -> None:
    reg = LimitRegistry()
    reg.configure([_tenant(tokens_per_minute=20_000)], now=0.0)
    assert reg.try_admit("t", 1_000, 0.0).allowed
    reg.settle("t", 1_000, 25_000, 0.0)  # used 24,000 more than it reserved
    verdict = reg.try_admit("t", 1_000, 0.0)
    # The bucket is at 20,000 - 25,000 = -5,000; 1,000 more need 6,000 tokens at 333.3/s.
    assert not verdict.allowed and verdict.limit == "tokens_per_minute"
    assert verdict.retry_after_s == pytest.approx(18.0)
    assert reg.try_admit("t", 1_000, 18.0).allowed
