"""The models of the queue's next requests (proxy.scheduling.queue_heads through the queue):
each tenant's head in each tier, followed through push, pop, removal and expiry; a model
wanted only deeper in a tenant's queue is not counted (that tenant's head goes first)."""

from __future__ import annotations

from proxy.policies.types import QueuedRequest, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.queue import AdmissionQueue
from proxy.scheduling.queue_heads import HeadModels


def _queue() -> AdmissionQueue:
    tiers = {"high": TierLimits(10, 100, 60.0), "low": TierLimits(1, 100, 5.0)}
    return AdmissionQueue(tiers, default_queue_policies(aging_s=30, reference_tokens=8192))


def _req(tier: str, tenant: str, model: str, at: float) -> QueuedRequest:
    return QueuedRequest(
        tier=tier, tenant=tenant, prompt_tokens=5, expected_output=5, arrival_s=at, model=model
    )


def test_only_each_tenants_next_request_counts() -> None:
    q = _queue()
    first = _req("high", "a", "lora-1", 0.0)
    q.push(first, 0.0)
    q.push(_req("high", "a", "lora-2", 0.1), 0.1)  # behind a's head
    q.push(_req("low", "b", "lora-1", 0.2), 0.2)
    assert set(q.tiers_wanting("lora-1")) == {"high", "low"}
    assert not q.tiers_wanting("lora-2")
    assert q.pop() is first  # a's next one is its head now
    assert set(q.tiers_wanting("lora-1")) == {"low"}
    assert set(q.tiers_wanting("lora-2")) == {"high"}


def test_requests_that_leave_the_queue_leave_no_head() -> None:
    q = _queue()
    gone = _req("high", "a", "lora-1", 0.0)
    q.push(gone, 0.0)
    q.push(_req("low", "b", "lora-2", 0.0), 0.0)
    assert q.remove(gone)
    assert not q.tiers_wanting("lora-1")
    assert [r.model for r in q.expire(10.0)] == ["lora-2"]  # the low tier's 5 s
    assert not q.tiers_wanting("lora-2")


def test_the_counts_follow_a_head_that_changes_model() -> None:
    heads = HeadModels()
    heads.set("t", "a", "x")
    heads.set("t", "b", "x")
    heads.set("t", "a", "y")
    assert list(heads.tiers_wanting("x")) == ["t"] and list(heads.tiers_wanting("y")) == ["t"]
    heads.set("t", "b", None)
    assert not heads.tiers_wanting("x")
