"""Fairness by the work a request caused: prompt tokens vLLM found in its prefix cache are
charged ``policies.vtc.cached_prompt_charge`` each, so of two backlogged tenants that send the same
tokens, the one whose prompts hit the cache gets more requests served, by that fraction."""

from __future__ import annotations

import heapq
from typing import Any

import pytest

from proxy.api.usage import TokenUsage, token_usage
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import until
from proxy.bench.vllm_answers import usage_of
from proxy.policies.cost import weighted_tokens, work_tokens
from proxy.policies.types import QueuedRequest, TierLimits
from proxy.scheduling.build import default_queue_policies
from proxy.scheduling.queue import AdmissionQueue
from tests.helpers.clock import FakeClock
from tests.helpers.rig import served_rig

PROMPT, CACHED, OUTPUT = 1000, 896, 20


def _usage(cached: int | None) -> dict[str, object]:
    """A chat answer's usage as vLLM 0.32 writes it (details null without the flag)."""
    details = {"cached_tokens": cached} if cached is not None else None
    return {
        "prompt_tokens": PROMPT,
        "completion_tokens": OUTPUT,
        "total_tokens": PROMPT + OUTPUT,
        "prompt_tokens_details": details,
    }


def test_cached_tokens_are_read_from_either_api_and_never_exceed_the_prompt() -> None:
    assert token_usage(_usage(CACHED)) == TokenUsage(PROMPT, OUTPUT, PROMPT + OUTPUT, CACHED)
    assert token_usage(_usage(None)) == TokenUsage(PROMPT, OUTPUT, PROMPT + OUTPUT, 0)
    responses = {
        "input_tokens": 6,
        "output_tokens": 4,
        "input_tokens_details": {"cached_tokens": 9},
    }
    assert token_usage(responses) == TokenUsage(6, 4, 10, 6)
    assert token_usage({**_usage(None), "prompt_tokens_details": {"cached_tokens": -3}}) == (
        TokenUsage(PROMPT, OUTPUT, PROMPT + OUTPUT, 0)
    )


def test_work_tokens_charge_cached_prompt_tokens_at_the_fraction() -> None:
    assert work_tokens(PROMPT, 0, OUTPUT, 0.1) == weighted_tokens(PROMPT, OUTPUT)
    assert work_tokens(PROMPT, CACHED, OUTPUT, 0.1) == pytest.approx(
        weighted_tokens(PROMPT - CACHED + 0.1 * CACHED, OUTPUT)
    )
    assert work_tokens(PROMPT, CACHED, OUTPUT, 1.0) == weighted_tokens(PROMPT, OUTPUT)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 1.0])
def test_the_tenant_whose_prompts_hit_the_cache_gets_more_served_by_the_fraction(
    fraction: float,
) -> None:
    clock = FakeClock()
    q = AdmissionQueue({"normal": TierLimits(1.0, 10**6, 10**6)}, default_queue_policies())
    # Both backlogged from the start, with the same prompts and outputs (same token volume
    # per request); only "reuse"'s answers say most of the prompt was cached.
    for tenant in ("reuse", "fresh"):
        for _ in range(400):
            q.push(QueuedRequest("normal", tenant, PROMPT, OUTPUT, clock()), clock())
    cached = {"reuse": CACHED, "fresh": None}
    served = {"reuse": 0, "fresh": 0}
    running: list[tuple[float, int, QueuedRequest]] = []
    slots, seq = 2, 0
    while sum(served.values()) < 300:  # both stay backlogged throughout
        while len(running) < slots and (req := q.pop()) is not None:
            counts = token_usage(_usage(cached[req.tenant]))
            assert counts is not None
            # The engine's time follows the tokens it computes: the prefill it skipped costs none.
            work = work_tokens(counts.prompt, counts.cached, counts.completion, 0.0)
            seq += 1
            heapq.heappush(running, (clock() + work / 10_000, seq, req))
        end, _, req = heapq.heappop(running)
        clock.advance(max(0.0, end - clock()))
        counts = token_usage(_usage(cached[req.tenant]))
        assert counts is not None
        charge = work_tokens(counts.prompt, counts.cached, counts.completion, fraction)
        q.correct_charge(req, charge)
        served[req.tenant] += 1
    # Equal charge per tenant: served in inverse proportion to each request's charge.
    expected = weighted_tokens(PROMPT, OUTPUT) / work_tokens(PROMPT, CACHED, OUTPUT, fraction)
    assert served["reuse"] / served["fresh"] == pytest.approx(expected, rel=0.05)
    if fraction < 1.0:
        assert served["reuse"] > served["fresh"]


class CachedFake(FakeVLLM):
    """Says 64 of its prompt tokens were cached, as vLLM with --enable-prompt-tokens-details."""

    def usage_body(self) -> dict[str, Any]:
        return {**usage_of(*self.usage), "prompt_tokens_details": {"cached_tokens": 64}}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_answers_cached_tokens_reach_the_charge_the_counters_and_the_metrics(
    clock: FakeClock, stream: bool
) -> None:
    fake = CachedFake(usage=(100, 3))
    policies = {"vtc": {"cached_prompt_charge": 0.25}}
    async with served_rig(clock, fake, policies=policies) as r:
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        assert (await r.chat("normal", **extra)).status == 200
        await until(lambda: r.vtc_counter("tenant-normal") > 0, 5, "charged")
        assert r.vtc_counter("tenant-normal") == pytest.approx(100 - 0.75 * 64 + 2 * 3)
        # The model is "other" here: the rig probes no backend for its models.
        labels = {"tenant": "tenant-normal", "tier": "normal", "model": "other", "outcome": "ok"}
        await until(lambda: r.metric("tierproxy_usage_requests_total", labels) == 1, 5, "counted")
        cached = r.metric("tierproxy_usage_tokens_total", {**labels, "kind": "cached_prompt"})
        assert cached == 64
        assert r.metric("tierproxy_tokens_total", {"tier": "normal", "kind": "cached_prompt"}) == 64
