"""Quotas and budgets on the request path (proxy.request.quota_gate): refused before the request
runs, 429 in OpenAI's shape with Retry-After to the UTC period's reset, settled to the usage the
backend reported (cached prompt tokens at their own price), the tier's quota as the default."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.config.scheduling import Limits, Scheduling
from proxy.config.tenants import Tier
from proxy.request.inbound import ParsedRequest, parse_body
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, Rig, error_of, served_rig, tenant, tenants

TENANT = "tenant-normal"
# Prices per million tokens chosen so that one token costs whole units: 2 per fresh prompt
# token, 0.5 per cached one, 10 per output token.
PRICING = {"tiny": {"input": 2_000_000, "cached_input": 500_000, "output": 10_000_000}}


TIER = Tier(priority=5, weight=5, max_queue=10, queue_timeout_s=60, request_timeout_s=120)


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


class CachingVLLM(FakeVLLM):
    """Reports 4 of its 7 prompt tokens as served from the prefix cache, as vLLM does with
    --enable-prompt-tokens-details."""

    def usage_body(self) -> dict[str, Any]:
        return {**super().usage_body(), "prompt_tokens_details": {"cached_tokens": 4}}


def parsed_body() -> ParsedRequest:
    """BODY as the test client sends it (json.dumps: its spaces count in the prompt's bound)."""
    return parse_body(json.dumps(BODY).encode(), "chat", TIER, Limits(), Scheduling())


def worst_case_tokens() -> int:
    """What a quota reserves for BODY: its prompt's upper bound (not its estimate), max_tokens."""
    parsed = parsed_body()
    return parsed.prompt_upper_bound + parsed.expected_output


def worst_case_cost() -> float:
    parsed = parsed_body()
    return parsed.prompt_upper_bound * 2 + parsed.expected_output * 10


def with_wall(r: Rig, start: str) -> FakeClock:
    wall = FakeClock(at(start))
    r.state.pipeline.quotas.wall = wall
    return wall


def used(r: Rig, counter: str, limit: float, wall: FakeClock) -> float:
    value: float = r.state.quota_book.usage(TENANT, {counter: limit}, wall())[counter]["used"]
    return value


async def test_over_the_daily_quota_429_until_midnight(clock: FakeClock) -> None:
    backend = FakeVLLM()  # reports 7 + 3 tokens per answer
    limit = worst_case_tokens() + 19
    quota = {"tokens_per_day": limit}
    async with served_rig(clock, backend, tenants=tenants(quota=quota)) as r:
        wall = with_wall(r, "2026-12-01T23:00:00")
        assert (await r.chat()).status == 200
        assert used(r, "tokens_per_day", limit, wall) == 10  # the reservation settled to usage
        assert (await r.chat()).status == 200
        # 20 used; this one's worst case (its prompt's bound and max_tokens 8) does not fit.
        resp = await r.chat()
        assert resp.status == 429
        error = await error_of(resp)
        assert error["code"] == "quota_exceeded" and error["type"] == "insufficient_quota"
        assert "tokens_per_day" in error["message"]
        assert resp.headers["Retry-After"] == "3600"  # to 00:00 UTC
        assert resp.headers["x-should-retry"] == "false"
        assert backend.served == 2  # refused before it ran
        assert r.requests_total("rate_limited") == 1
        labels = {"tenant": TENANT, "limit": "tokens_per_day"}
        assert r.metric("tierproxy_rate_limited_total", labels) == 1
        assert used(r, "tokens_per_day", limit, wall) == 20  # a refusal takes nothing
        wall.advance(3600)
        assert (await r.chat()).status == 200


async def test_budget_charges_cached_tokens_at_their_price(clock: FakeClock) -> None:
    backend = CachingVLLM()
    records: list[dict[str, Any]] = []
    budget = 1000
    quota = {"budget_per_month": budget}
    config: dict[str, Any] = {"tenants": tenants(quota=quota), "pricing": PRICING}
    async with served_rig(clock, backend, **config) as r:
        r.state.usage.sink = lambda line: records.append(orjson.loads(line))
        wall = with_wall(r, "2026-12-31T20:00:00")
        answered = 0
        while (resp := await r.chat()).status == 200:
            answered += 1
            # 3 fresh prompt tokens x 2 + 4 cached x 0.5 + 3 output x 10 = 38.
            assert used(r, "budget_per_month", budget, wall) == pytest.approx(38 * answered)
        # Its worst case: the prompt's upper bound uncached at 2, max_tokens 8 at 10.
        worst = worst_case_cost()
        assert 38 * (answered - 1) + worst <= budget < 38 * answered + worst
        assert answered > budget // worst  # more than its worst cases alone would let through
        error = await error_of(resp)
        assert error["code"] == "budget_exceeded" and error["type"] == "insufficient_quota"
        assert resp.headers["Retry-After"] == str(4 * 3600)  # to 2027-01-01 00:00 UTC
        ok = [rec for rec in records if rec["outcome"] == "ok"]
        assert len(ok) == answered
        assert all(
            rec["cost"] == pytest.approx(38) and rec["cached_prompt_tokens"] == 4 for rec in ok
        )
        assert records[-1]["outcome"] == "rate_limited" and records[-1]["cost"] == 0


async def test_the_tiers_quota_is_each_tenants_default(clock: FakeClock) -> None:
    backend = FakeVLLM()
    tiers = {"normal": {"quota": {"tokens_per_day": worst_case_tokens() + 5}}}
    people = [
        *tenants(),
        tenant("twin", "normal", "key-twin"),
        tenant("free", "normal", "k", quota={}),
    ]
    async with served_rig(clock, backend, tiers=tiers, tenants=people) as r:
        with_wall(r, "2026-12-01T12:00:00")
        assert (await r.chat()).status == 200
        assert (await r.chat()).status == 429  # tenant-normal: the tier's quota a day
        # Each tenant of the tier has a quota of its own, of the tier's size.
        twin = {"Authorization": "Bearer key-twin"}
        assert (await r.client.post("/v1/chat/completions", json=BODY, headers=twin)).status == 200
        assert (await r.chat(tier="low")).status == 200  # another tier: none
        free = {"Authorization": "Bearer k"}  # `quota: {}`: out of the tier's quota
        for _ in range(3):
            assert (
                await r.client.post("/v1/chat/completions", json=BODY, headers=free)
            ).status == 200


async def test_a_rate_limit_refusal_gives_the_quota_back(clock: FakeClock) -> None:
    backend = FakeVLLM()
    people = tenants(requests_per_minute=1, quota={"tokens_per_day": 1000})
    async with served_rig(clock, backend, tenants=people) as r:
        wall = with_wall(r, "2026-12-01T12:00:00")
        assert (await r.chat()).status == 200
        refused = await r.chat()
        assert refused.status == 429 and (await error_of(refused))["code"] == "rate_limit_exceeded"
        # The rate limit said no after the quota reserved: nothing ran, nothing is charged.
        assert used(r, "tokens_per_day", 1000, wall) == 10
