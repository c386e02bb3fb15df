"""tokens_per_minute is a bound (issue 22's fresh-eyes finding 6): the output estimate counts
every prompt vLLM runs and what a chat template renders, and a request whose estimate exceeds
the tenant's whole bucket is refused (429, ``x-should-retry: false``) instead of passing once
the bucket is full. The served twin: tests/adversarial/served/test_billing.py."""

from __future__ import annotations

import orjson
import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config
from proxy.config.scheduling import Limits, Scheduling
from proxy.config.tenants import Tier
from proxy.request.inbound import parse_body
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, error_of, rig, tenants

TIER = Tier(priority=0, weight=1, max_queue=10, queue_timeout_s=10, request_timeout_s=60)
LIMITS = Limits(max_tokens_ceiling=100_000)
SCHED = Scheduling(chars_per_token=4)


def expected(endpoint: str, body: dict[str, object]) -> int:
    return parse_body(orjson.dumps(body), endpoint, TIER, LIMITS, SCHED).expected_output  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [("one", 1), (["a"] * 200, 200), ([[1, 2], [3], [4]], 3), ([1, 2, 3], 1)],
)
def test_every_prompt_of_a_completions_list_is_expected_to_generate(
    prompt: object, prompts: int
) -> None:
    # Before: max_tokens x n, whatever the number of prompts vLLM runs.
    body = {"model": "m", "prompt": prompt, "max_tokens": 2048, "n": 2}
    assert expected("completions", body) == 2048 * 2 * prompts


def test_chat_documents_and_template_kwargs_count_as_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    bare = parse_body(orjson.dumps({"messages": messages}), "chat", TIER, LIMITS, SCHED)
    documents = [{"title": "t", "text": "x" * 40_000}]
    body = {"messages": messages, "documents": documents, "chat_template_kwargs": {"k": "y" * 400}}
    rag = parse_body(orjson.dumps(body), "chat", TIER, LIMITS, SCHED)
    assert rag.prompt_tokens - bare.prompt_tokens >= (40_000 + 400) // 4


async def test_a_request_over_the_whole_bucket_is_refused_for_good(clock: FakeClock) -> None:
    # Before: the bucket was full, so the request passed (a prompt list of 200 at max_tokens
    # 2048 ran 68 times the minute's limit; here four choices of 2000 tokens, 8000 > 6000).
    backend = FakeVLLM()
    async with backend.serve() as url:
        config = make_config([{"url": url}], tenants=tenants(tokens_per_minute=6000))
        async with rig(config, clock) as r:
            resp = await r.client.post(
                "/v1/chat/completions",
                json={**BODY, "n": 4, "max_tokens": 2000},
                headers=auth("normal"),
            )
            assert resp.status == 429
            assert resp.headers["x-should-retry"] == "false" and "Retry-After" not in resp.headers
            error = await error_of(resp)
            assert error["code"] == "request_over_token_limit" and "6000" in error["message"]
            assert backend.received == []
            window = r.state.limits.windows("tenant-normal", clock())["tokens"]
            assert window.remaining == 6000  # a refused request takes nothing
            assert (await r.chat(max_tokens=5000)).status == 200  # under the bucket: as before


def parsed_for(endpoint: str, body: dict[str, object], tier: Tier = TIER) -> tuple[object, int]:
    """(the max_tokens sent on, the output estimate) for a tenant of tokens_per_minute 6000."""
    parsed = parse_body(orjson.dumps(body), endpoint, tier, LIMITS, SCHED, token_limit=6000)  # type: ignore[arg-type]
    return parsed.body.get("max_tokens"), parsed.expected_output


def test_without_max_tokens_each_sequence_gets_its_share_of_the_limit() -> None:
    # Before: no max_tokens went on as none (chat runs to the context's end: 32k tokens
    # against 6000 a minute), estimated 256 each, the debt past a minute forgiven.
    assert parsed_for("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2}) == (
        3000,
        512,
    )
    # A tier cap above the share: the share, and the request still fits the bucket.
    capped = Tier(**{**TIER.model_dump(), "max_tokens": 8192})
    chat: dict[str, object] = {"messages": [{"role": "user", "content": "x"}]}
    assert parsed_for("chat", chat, capped) == (6000, 6000)
    # Completions without max_tokens run vLLM's default, 16 (red team, stop 50: the proxy
    # sent its share, 260 tokens each, and billed them): the share only where it is less.
    assert parsed_for("completions", {"prompt": ["p"] * 23}) == (None, 16 * 23)  # none sent on
    assert parsed_for("completions", {"prompt": ["p"] * 1000}) == (6, 6 * 1000)
    assert parsed_for("completions", {"prompt": "p"}, capped) == (None, 16)
    small = Tier(**{**TIER.model_dump(), "max_tokens": 8})
    assert parsed_for("completions", {"prompt": "p"}, small) == (8, 8)  # the tier's cap, lower
    # What the client set is its own: over the limit, the pipeline refuses it.
    assert parsed_for("completions", {"prompt": "p", "max_tokens": 9000}) == (9000, 9000)
