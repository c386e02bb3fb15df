"""Quotas reserve an upper bound of the prompt's tokens, not its chars/4 estimate (fresh eyes
q01): a concurrent burst of prompts that tokenize far above the estimate (CJK: ~3 tokens a
character) passes the quota by at most about one request, not 9 times over."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import until
from proxy.config.scheduling import Limits, Scheduling
from proxy.config.server import InputLimits
from proxy.config.tenants import Tier
from proxy.request.inbound import parse_body
from proxy.request.prompt_bound import MESSAGE_TOKENS, TEMPLATE_TOKENS
from tests.helpers.clock import FakeClock
from tests.helpers.rig import served_rig, tenants

TENANT = "tenant-normal"
TIER = Tier(priority=5, weight=5, max_queue=64, queue_timeout_s=60, request_timeout_s=120)
CJK = "\u4e00\u4e01" * 10_000  # 20,000 characters: an estimate of 5,000 tokens
REAL = (60_000, 10)  # what the tiny model's tokenizer makes of it: ~3 tokens a character
LIMIT = 200_000


def cjk_body() -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": CJK}], "max_tokens": 10}


def test_the_bound_is_above_the_real_count_where_the_estimate_is_far_below() -> None:
    parsed = parse_body(json.dumps(cjk_body()).encode(), "chat", TIER, Limits(), Scheduling())
    assert parsed.prompt_tokens == 5_003  # chars/4: what fairness and tokens_per_minute use
    assert parsed.prompt_upper_bound >= REAL[0]  # json.dumps escapes: 6 bytes a character
    raw = json.dumps(cjk_body(), ensure_ascii=False).encode()
    literal = parse_body(raw, "chat", TIER, Limits(), Scheduling())
    overhead = TEMPLATE_TOKENS + MESSAGE_TOKENS  # the template's, once and per message
    assert REAL[0] <= literal.prompt_upper_bound <= len(raw) + overhead  # its UTF-8 bytes


def test_media_parts_count_the_configured_maximum_not_their_base64() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    content = [{"type": "text", "text": "what is this?"}, image, image]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    inputs = InputLimits(max_tokens_per_media_item=300)
    raw = json.dumps(body).encode()
    parsed = parse_body(raw, "chat", TIER, Limits(), Scheduling(), inputs=inputs)
    assert 2 * 300 < parsed.prompt_upper_bound < 2 * 300 + 400  # the text's bytes, 2 images


async def test_a_concurrent_cjk_burst_stays_within_the_day_quota(clock: FakeClock) -> None:
    backend = FakeVLLM(usage=REAL)
    backend.gate.clear()  # every admitted request held at the backend: all reserve at once
    people = tenants(quota={"tokens_per_day": LIMIT})
    async with served_rig(clock, backend, tenants=people, backend={"max_inflight": 64}) as r:
        r.state.pipeline.quotas.wall = FakeClock(datetime(2026, 12, 1, 12, tzinfo=UTC).timestamp())
        burst = [asyncio.create_task(r.chat(messages=cjk_body()["messages"])) for _ in range(30)]
        # Each request either was refused (done) or waits at the backend.
        await until(lambda: sum(t.done() for t in burst) + backend.active == 30, 10, "the burst")
        backend.gate.set()
        statuses = [resp.status for resp in await asyncio.gather(*burst)]
        admitted = statuses.count(200)
        assert admitted + statuses.count(429) == 30
        billed = admitted * sum(REAL)
        # Before: all 30 admitted, 1,800,300 tokens billed (9x). Now: at most one over.
        assert admitted > 0 and billed <= LIMIT + sum(REAL), statuses
        used = r.state.quota_book.usage(
            TENANT, {"tokens_per_day": LIMIT}, r.state.pipeline.quotas.wall()
        )
        assert used["tokens_per_day"]["used"] == billed
