"""The queue's heaps and buckets pick exactly what a plain linear scan over every queued request
picks, across random sequences of push, pop (with and without an accept filter), remove,
expire and usage correction, with the default policies."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.policies.order import short_first_key
from proxy.policies.tenants import VirtualTokenCounter
from proxy.policies.tiers import StrideTierSelector
from proxy.policies.types import QueuedRequest, State, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.queue import AdmissionQueue, QueueFull

TIERS = {"gold": TierLimits(3.0, 4, 5.0), "iron": TierLimits(1.0, 5, 8.0)}
TENANT_WEIGHTS = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 0.5}
AGING_S, REFERENCE_TOKENS = 10.0, 400.0


@dataclass(eq=False)
class Ref:
    """A queued request as the reference sees it."""

    tier: str
    tenant: str
    cost: float
    weight: float
    arrival: float
    model: str
    seq: int
    key: float
    deadline: float


class LinearQueue:
    """The reference: every decision is a scan over all queued requests."""

    def __init__(self) -> None:
        self.queued: list[Ref] = []
        self.counter: dict[str, float] = {}
        self.place: dict[tuple[str, str], tuple[float, int, int]] = {}  # weight, depth, stamp
        self.stamps = itertools.count()
        self.selector = StrideTierSelector()
        self.selector.set_tiers(TIERS)

    def of(self, tier: str, tenant: str | None = None) -> list[Ref]:
        return [r for r in self.queued if r.tier == tier and tenant in (None, r.tenant)]

    def tenants(self, tier: str) -> list[str]:
        return sorted({r.tenant for r in self.of(tier)})

    def push(self, r: Ref, force: bool) -> Ref | None:
        displaced = None
        if not force and len(self.of(r.tier)) >= TIERS[r.tier].max_queue:
            displaced = self.victim(r)
            if displaced is None:
                raise QueueFull(r.tier, len(self.of(r.tier)))
            self.forget(displaced)
        if not self.of(r.tier):
            self.selector.activate(r.tier, {q.tier for q in self.queued})
        if not self.of(r.tier, r.tenant):
            others = [self.counter.get(t, 0.0) for t in self.tenants(r.tier)]
            floor = min(others) if others else max(self.counter.values(), default=0.0)
            self.counter[r.tenant] = max(self.counter.get(r.tenant, 0.0), floor)
        self.queued.append(r)
        self.replace(r.tier, r.tenant)
        return displaced

    def victim(self, r: Ref) -> Ref | None:
        my_share = (len(self.of(r.tier, r.tenant)) + 1) / r.weight
        best: tuple[float, int, str] | None = None
        for tenant in self.tenants(r.tier):
            if tenant == r.tenant:
                continue
            weight, depth, stamp = self.place[(r.tier, tenant)]
            share = (depth - 1) / weight
            if best is None or (share, -stamp) > (best[0], -best[1]):
                best = (share, stamp, tenant)
        if best is None or best[0] < my_share:
            return None
        return max(self.of(r.tier, best[2]), key=lambda q: q.seq)

    def replace(self, tier: str, tenant: str) -> None:
        """Stamp the tenant's (weight, depth) when it changes: ties of share go to the first."""
        mine = self.of(tier, tenant)
        if not mine:
            self.place.pop((tier, tenant), None)
            return
        place = (max(mine, key=lambda q: q.seq).weight, len(mine))
        old = self.place.get((tier, tenant))
        if old is None or old[:2] != place:
            self.place[(tier, tenant)] = (*place, next(self.stamps))

    def forget(self, r: Ref) -> None:
        self.queued.remove(r)
        self.replace(r.tier, r.tenant)

    def pop(self, model: str | None) -> Ref | None:
        tiers = {r.tier for r in self.queued}
        while tiers:
            tier = self.selector.pick(tiers)
            assert tier is not None

            for tenant in sorted(self.tenants(tier), key=functools.partial(self.rank, tier)):
                head = min(self.of(tier, tenant), key=lambda q: (q.key, q.seq))
                if model is None or head.model == model:
                    self.forget(head)
                    self.selector.charge(tier)
                    self.counter[tenant] = self.counter.get(tenant, 0.0) + head.cost / head.weight
                    return head
            tiers.discard(tier)
        return None

    def rank(self, tier: str, tenant: str) -> tuple[float, float, str]:
        """Least service first; on a tie, who has waited longest; then the name."""
        oldest = min(r.arrival for r in self.of(tier, tenant))
        return (self.counter.get(tenant, 0.0), oldest, tenant)

    def expire(self, now: float) -> list[Ref]:
        due = sorted(
            (r for r in self.queued if r.deadline <= now), key=lambda q: (q.deadline, q.seq)
        )
        for r in due:
            self.forget(r)
        return due


def _serving(model: str) -> Callable[[QueuedRequest], bool]:
    return lambda r: r.model == model


Op = tuple[str, int, int, int, bool]
ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["push", "push", "push", "pop", "pop", "remove", "expire", "correct", "forget"]
        ),
        st.integers(0, 7),
        st.integers(0, 3),
        st.integers(0, 600),
        st.booleans(),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_queue_picks_what_a_linear_scan_picks(sequence: list[Op]) -> None:
    vtc = VirtualTokenCounter()
    queue = AdmissionQueue(
        TIERS,
        replace(
            default_queue_policies(aging_s=AGING_S, reference_tokens=REFERENCE_TOKENS), tenants=vtc
        ),
    )
    ref = LinearQueue()
    pairs: dict[int, Ref] = {}  # seq -> reference twin
    live: list[QueuedRequest] = []
    done: list[QueuedRequest] = []
    charged: dict[int, float] = {}  # seq -> the fairness charge its last correction set
    now = 0.0
    for kind, a, b, size, flag in sequence:
        now += 0.5 * (a % 3)  # ties in time are common on purpose
        if kind == "push":
            tier = "gold" if a % 2 else "iron"
            tenant = "abcd"[b]
            req = QueuedRequest(
                tier,
                tenant,
                size,
                size // 3 + 1,
                now,
                model=f"m{a % 2}",
                tenant_weight=TENANT_WEIGHTS[tenant],
            )
            try:
                displaced = queue.push(req, now, force=flag and a < 2)
            except QueueFull:
                ref_full = False
                try:
                    ref.push(
                        Ref(tier, tenant, req.cost, req.tenant_weight, now, "", -1, 0.0, 0.0),
                        flag and a < 2,
                    )
                except QueueFull:
                    ref_full = True
                assert ref_full
                continue
            twin = Ref(
                tier,
                tenant,
                req.cost,
                req.tenant_weight,
                now,
                req.model or "",
                req.seq,
                short_first_key(req.cost, now, reference_tokens=REFERENCE_TOKENS, aging_s=AGING_S),
                req.deadline_s,
            )
            pairs[req.seq] = twin
            ref_displaced = ref.push(twin, flag and a < 2)
            assert (displaced.seq if displaced else None) == (
                ref_displaced.seq if ref_displaced else None
            )
            live.append(req)
        elif kind == "pop":
            model = None if flag else f"m{a % 2}"
            popped = queue.pop(None if model is None else _serving(model))
            ref_popped = ref.pop(model)
            assert (popped.seq if popped else None) == (ref_popped.seq if ref_popped else None)
            if popped is not None:
                done.append(popped)
        elif kind == "remove" and live:
            req = live[a % len(live)]
            if queue.remove(req):
                ref.forget(pairs[req.seq])
        elif kind == "expire":
            assert [r.seq for r in queue.expire(now)] == [r.seq for r in ref.expire(now)]
        elif kind == "correct" and done:
            req = done[a % len(done)]
            before = charged.get(req.seq, req.cost)  # what its dispatch, or a correction, charged
            queue.correct_charge(req, float(size))
            charged[req.seq] = float(size)  # a correction replaces the last
            ref.counter[req.tenant] = (
                ref.counter.get(req.tenant, 0.0) + (size - before) / req.tenant_weight
            )
        elif kind == "forget":  # a reload dropped a tenant: its history goes
            gone = "abcd"[b]
            vtc.forget(t for t in TENANT_WEIGHTS if t != gone)
            ref.counter.pop(gone, None)
        live = [r for r in live if r.state is State.QUEUED]
        assert sorted(r.seq for r in queue.queued()) == sorted(r.seq for r in ref.queued)
        for tenant in TENANT_WEIGHTS:
            assert vtc.counter(tenant) == ref.counter.get(tenant, 0.0)
