import pytest

from proxy.policies.order import ShortFirst
from proxy.policies.types import QueuedRequest, State, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.queue import AdmissionQueue, QueueFull
from tests.helpers.clock import FakeClock


def _queue() -> AdmissionQueue:
    return AdmissionQueue(
        {
            "high": TierLimits(weight=10, max_queue=3, queue_timeout_s=10),
            "low": TierLimits(weight=1, max_queue=2, queue_timeout_s=60),
        },
        default_queue_policies(aging_s=30, reference_tokens=8192),
    )


def _req(tier: str, clock: FakeClock, tenant: str = "t") -> QueuedRequest:
    return QueuedRequest(
        tier=tier, tenant=tenant, prompt_tokens=10, expected_output=10, arrival_s=clock()
    )


def test_cap_rejects_immediately_per_tier() -> None:
    clock, q = FakeClock(), _queue()
    for _ in range(3):
        q.push(_req("high", clock), clock())
    with pytest.raises(QueueFull) as exc:
        q.push(_req("high", clock), clock())
    assert exc.value.tier == "high" and exc.value.depth == 3
    q.push(_req("low", clock), clock())  # other tiers are unaffected
    assert q.depth("high") == 3 and q.depth("low") == 1


def test_forced_push_bypasses_cap_for_already_admitted_requests() -> None:
    clock, q = FakeClock(), _queue()
    for _ in range(3):
        q.push(_req("high", clock), clock())
    retry = _req("high", clock)
    q.push(retry, clock(), force=True)
    assert q.depth("high") == 4


def test_expire_takes_out_exactly_the_overdue() -> None:
    clock, q = FakeClock(), _queue()
    old_high = _req("high", clock)
    q.push(old_high, clock())
    clock.now += 5
    young_high = _req("high", clock)
    q.push(young_high, clock())
    low = _req("low", clock)
    q.push(low, clock())
    clock.now += 5.0  # old_high reaches its 10 s deadline exactly
    assert q.expire(clock()) == [old_high]
    assert old_high.state is State.EXPIRED
    assert q.next_deadline() == pytest.approx(young_high.deadline_s)
    clock.now += 100
    assert set(q.expire(clock())) == {young_high, low}
    assert len(q) == 0 and q.pop() is None


def test_removed_request_leaves_nothing_behind() -> None:
    clock, q = FakeClock(), _queue()
    a, b = _req("high", clock, "x"), _req("high", clock, "x")
    q.push(a, clock())
    q.push(b, clock())
    assert q.remove(a) is True
    assert q.remove(a) is False  # idempotent
    assert q.depth("high") == 1
    assert q.pop() is b
    assert len(q) == 0
    assert q.backlogged_tenants("high") == []
    assert q.expire(clock() + 1e6) == []  # the removed one does not come back as expired
    assert q.next_deadline() is None


def test_dispatched_request_cannot_be_removed_or_expired() -> None:
    clock, q = FakeClock(), _queue()
    a = _req("low", clock)
    q.push(a, clock())
    assert q.pop() is a and a.state is State.DISPATCHED
    assert q.remove(a) is False
    assert q.expire(clock() + 1e6) == []


def test_pop_honours_accept_filter_without_losing_requests() -> None:
    clock, q = FakeClock(), _queue()
    a = QueuedRequest("high", "t1", 10, 10, clock(), model="m1")
    b = QueuedRequest("high", "t2", 10, 10, clock(), model="m2")
    q.push(a, clock())
    q.push(b, clock())
    assert q.pop(lambda r: r.model == "m2") is b
    assert q.pop(lambda r: r.model == "m2") is None
    assert q.depth("high") == 1
    assert q.pop() is a


def test_reconfigure_changes_caps_and_keeps_draining_removed_tier() -> None:
    clock, q = FakeClock(), _queue()
    q.push(_req("low", clock), clock())
    q.reconfigure(
        {"high": TierLimits(weight=1, max_queue=1, queue_timeout_s=5)},
        order=ShortFirst(aging_s=10, reference_tokens=100),
    )
    q.push(_req("high", clock), clock())
    with pytest.raises(QueueFull):
        q.push(_req("high", clock), clock())
    # The low tier left the config but its request is still served.
    assert {q.pop().tier, q.pop().tier} == {"high", "low"}  # type: ignore[union-attr]


def _fill(
    q: AdmissionQueue, clock: FakeClock, tier: str, tenant: str, n: int, weight: float = 1.0
) -> list[QueuedRequest]:
    reqs = []
    for _ in range(n):
        r = _req(tier, clock, tenant)
        r.tenant_weight = weight
        assert q.push(r, clock()) is None
        reqs.append(r)
        clock.now += 0.1
    return reqs


def test_full_tier_displaces_the_newest_of_the_tenant_holding_most_of_it() -> None:
    clock, q = FakeClock(), _queue()
    heavy = _fill(q, clock, "high", "heavy", 3)  # the whole cap
    light = _req("high", clock, "light")
    displaced = q.push(light, clock())
    assert displaced is heavy[-1] and displaced.state is State.DISPLACED
    assert q.depth("high") == 3 and light.state is State.QUEUED
    # Nothing displaced is handed out later, and the rest is all there.
    popped = [q.pop(), q.pop(), q.pop()]
    assert set(map(id, popped)) == {id(heavy[0]), id(heavy[1]), id(light)} and q.pop() is None


def test_full_tier_refuses_the_tenant_holding_most_of_it_and_equal_shares() -> None:
    clock, q = FakeClock(), _queue()
    _fill(q, clock, "high", "heavy", 2)
    _fill(q, clock, "high", "light", 1)
    with pytest.raises(QueueFull):  # the flooding tenant itself
        q.push(_req("high", clock, "heavy"), clock())
    with pytest.raises(QueueFull):  # 2 vs 1+1: displacing would only swap the imbalance
        q.push(_req("high", clock, "light"), clock())
    assert q.depth("high") == 3


def test_displacement_weighs_shares_by_tenant_weight() -> None:
    clock, q = FakeClock(), _queue()
    _fill(q, clock, "high", "big", 3, weight=4.0)  # 3 queued for weight 4: under its share
    small = _req("high", clock, "small")
    with pytest.raises(QueueFull):
        q.push(small, clock())


def test_displaced_requests_leave_no_trace_behind() -> None:
    clock, q = FakeClock(), _queue()
    for _ in range(50):  # a flood keeps being displaced by arrivals of other tenants
        _fill(q, clock, "low", "heavy", 2 - q.depth("low"))
        q.push(_req("low", clock, "light"), clock())
        assert q.pop() is not None and q.pop() is not None
    assert len(q) == 0 and not q.backlogged_tenants("low")
