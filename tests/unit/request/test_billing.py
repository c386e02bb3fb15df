"""What a request is billed as before it runs (proxy.request.billing, proxy.request.quota_gate):
a request without ``model`` at the price of the model vLLM runs for it, never free; refused with
a budget and no price at all; an unbounded output bounded by the model's context and cut to
what the tenant's quotas still pay for."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.api.errors import ProxyError
from proxy.api.routes import Endpoint
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, running_proxy, serve_app, until
from proxy.config.quotas import Price
from proxy.config.scheduling import Limits, Scheduling
from proxy.config.tenants import Tier
from proxy.request.billing import (
    Billed,
    affordable_output,
    billed_as,
    default_models,
    model_context,
)
from proxy.request.inbound import ParsedRequest, parse_body
from tests.helpers.clock import FakeClock
from tests.helpers.rig import Rig, error_of, served_rig, tenants

PRICES = {"tiny": Price(input=1.0, output=2.0), "big": Price(input=5.0, output=9.0)}
# One token costs whole units: 2 per prompt token, 10 per output token.
PRICING = {"tiny": {"input": 2_000_000, "output": 10_000_000}}
CARDS: tuple[dict[str, object], ...] = ({"id": "tiny", "parent": None, "max_model_len": 2048},)


def test_default_models_are_each_backends_first_base_model() -> None:
    adapter = {"id": "sql-lora", "parent": "tiny"}
    backends = [(adapter, {"id": "tiny"}), ({"id": "big"}, {"id": "tiny"}), ()]
    assert default_models(backends) == ["tiny", "big"]


def test_a_named_model_is_billed_as_itself() -> None:
    assert billed_as("tiny", PRICES, ["big"]) == Billed("tiny", PRICES["tiny"])
    assert billed_as("other", PRICES, ["big"]) == Billed("other", None)


def test_without_a_model_the_dearest_default_or_the_star_price() -> None:
    assert billed_as(None, PRICES, ["tiny", "big"]) == Billed("big", PRICES["big"])
    star = {**PRICES, "*": Price(input=3.0, output=3.0)}
    assert billed_as(None, star, []) == Billed(None, star["*"])
    assert billed_as(None, star, ["unlisted"]) == Billed("unlisted", star["*"])  # by its glob
    assert billed_as(None, PRICES, []) == Billed(None, None)


def test_model_context_is_the_largest_reported() -> None:
    backends: list[tuple[dict[str, object], ...]] = [
        CARDS,
        ({"id": "tiny", "max_model_len": 4096},),
        ({"id": "tiny"},),
    ]
    assert model_context("tiny", backends) == 4096
    assert model_context("big", backends) is None
    flagged: tuple[dict[str, object], ...] = ({"id": "tiny", "max_model_len": True},)
    assert model_context("tiny", [flagged]) is None


def test_affordable_output_takes_the_tightest_counter() -> None:
    price = Price(input=1_000_000, output=2_000_000)  # 1 a prompt token, 2 an output token
    limits = {"tokens_per_day": 1000.0, "budget_per_day": 500.0}
    used = {"tokens_per_day": 100.0, "budget_per_day": 300.0}
    # tokens: (900 - 50) / 2 = 425; money: (200 - 50) / (2 * 2) = 37.
    assert affordable_output(limits, used, prompt=50, price=price, sequences=2) == 37
    assert affordable_output({}, used, prompt=50, price=price, sequences=1) is None
    budget_only = {"budget_per_day": 500.0}
    assert affordable_output(budget_only, used, prompt=50, price=None, sequences=1) is None


def _with_cards(r: Rig) -> None:
    for state in r.state.pool.all():
        state.model_cards = CARDS


async def _post(r: Rig, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await r.client.post("/v1/chat/completions", json=body, headers=auth("normal"))
    raw = await resp.read()
    return resp.status, orjson.loads(raw)


CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


@pytest.mark.parametrize("model", [{}, {"model": None}], ids=["absent", "null"])
async def test_a_request_without_model_spends_the_budget(
    clock: FakeClock, model: dict[str, Any]
) -> None:
    """Before issue 30 such requests cost nothing: 20 of 20 passed a spent budget."""
    records: list[dict[str, Any]] = []
    config: dict[str, Any] = {"tenants": tenants(quota={"budget_per_day": 400}), "pricing": PRICING}
    async with served_rig(clock, FakeVLLM(), **config) as r:
        _with_cards(r)
        r.state.usage.sink = lambda line: records.append(orjson.loads(line))
        statuses = [(await _post(r, {**CHAT, **model}))[0] for _ in range(20)]
        assert 200 in statuses and statuses.count(429) >= 10
        assert statuses.index(429) < 10  # 44 a request (7 x 2 + 3 x 10) of 400, worst 2 + 8
        ok = [rec for rec in records if rec["outcome"] == "ok"]
        assert ok and all(rec["model"] == "tiny" and rec["cost"] == 44 for rec in ok)


async def test_a_budget_without_any_price_refuses_clearly(clock: FakeClock) -> None:
    config: dict[str, Any] = {"tenants": tenants(quota={"budget_per_day": 400}), "pricing": {}}
    backend = FakeVLLM()
    async with served_rig(clock, backend, **config) as r:
        _with_cards(r)
        for body in ({**CHAT}, {**CHAT, "model": "tiny"}):
            resp = await r.client.post("/v1/chat/completions", json=body, headers=auth("normal"))
            assert resp.status == 400
            error = await error_of(resp)
            assert error["code"] == "model_not_priced" and error["param"] == "model"
        assert backend.served == 0


async def test_a_quota_without_a_budget_needs_no_price(clock: FakeClock) -> None:
    config: dict[str, Any] = {"tenants": tenants(quota={"tokens_per_day": 10_000})}
    async with served_rig(clock, FakeVLLM(), **config) as r:
        assert (await _post(r, {**CHAT, "model": "tiny"}))[0] == 200


async def test_an_unbounded_output_is_cut_at_what_the_budget_still_pays(clock: FakeClock) -> None:
    backend = FakeVLLM()
    quota = {"budget_per_day": 1000, "tokens_per_day": 100_000}
    config: dict[str, Any] = {"tenants": tenants(quota=quota), "pricing": PRICING}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
    async with served_rig(clock, backend, **config) as r:
        _with_cards(r)
        assert (await _post(r, body))[0] == 200
        # What the budget pays after the prompt's bound (at 2 a token): under 100 at 10 a
        # token, not the model's 2,048.
        assert 0 < backend.received[-1].body["max_tokens"] < 100
        for state in r.state.pool.all():
            state.model_cards = ({"id": "tiny", "max_model_len": 50},)
        assert (await _post(r, body))[0] == 200
        assert backend.received[-1].body["max_tokens"] == 50  # the context


async def test_without_a_quota_the_output_is_left_as_sent(clock: FakeClock) -> None:
    backend = FakeVLLM()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
    async with served_rig(clock, backend) as r:
        _with_cards(r)
        assert (await _post(r, body))[0] == 200
        assert "max_tokens" not in backend.received[-1].body


async def test_a_max_tokens_past_the_context_gets_vllms_400_at_once_beside_busy_work(
    clock: FakeClock,
) -> None:
    """vLLM's chat and completions refuse an output budget past the model's context (2,048)
    before any work: the proxy answers so at once, even while the backend's token budget is
    taken (it waited for an idle backend, then a 503 after its queue timeout: red team)."""
    backend = FakeVLLM()
    async with served_rig(clock, backend, backend={"max_tokens_inflight": 6000}) as r:
        _with_cards(r)
        backend.gate.clear()
        held = asyncio.create_task(_post(r, {**CHAT, "model": "tiny", "max_tokens": 1000}))
        await until(lambda: backend.active == 1, 5, "the first request at the backend")
        for field in ("max_tokens", "max_completion_tokens"):
            body = {**CHAT, "model": "tiny", field: 1_000_000, "n": 8}
            status, answer = await _post(r, body)
            assert status == 400 and answer["error"]["param"] == field, answer
            assert f"{field}=1000000 cannot be greater than max_model_len=2048" in answer["error"]["message"]  # fmt: skip
        within = asyncio.create_task(_post(r, {**CHAT, "model": "tiny", "max_tokens": 2048}))
        await until(lambda: backend.active == 2, 5, "one within the context, beside it")
        assert len(backend.received) == 2 and len(r.state.queue) == 0
        backend.gate.set()
        assert [(await t)[0] for t in (held, within)] == [200, 200]


async def test_a_tokens_per_minute_share_is_sent_at_most_as_the_context(clock: FakeClock) -> None:
    """A tenant whose tokens_per_minute is past the context: a request without max_tokens is
    sent with the context as its max_tokens, not its share of the limit (vLLM refuses a
    max_tokens past max_model_len: every such request got a 400)."""
    backend = FakeVLLM()
    config: dict[str, Any] = {"tenants": tenants(tokens_per_minute=100_000)}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
    async with served_rig(clock, backend, **config) as r:
        _with_cards(r)
        assert (await _post(r, body))[0] == 200
        assert backend.received[-1].body["max_tokens"] == 2048
        assert (await _post(r, {**body, "n": 100}))[0] == 200  # a share under the context
        assert backend.received[-1].body["max_tokens"] == 1000


def test_every_generating_route_keeps_its_output_budget_within_the_context() -> None:
    """vLLM's chat, completions and responses refuse a budget past max_model_len: the client's
    gets that refusal; the proxy's own (here a tokens_per_minute share) is cut to the context
    (red team, stop 50: a responses request without max_output_tokens got vLLM's 400)."""
    routes: list[tuple[Endpoint, str]] = [("responses", "max_output_tokens"), ("completions", "max_tokens")]  # fmt: skip
    for endpoint, field in routes:
        body: dict[str, Any] = {field: 1_000_000}
        client = ParsedRequest(body, endpoint, False, "tiny", 1, 1_000_000, 1_000_000, False)
        with pytest.raises(ProxyError) as refused:
            client.keep_output_within(2048)
        assert refused.value.status == 400 and refused.value.param == field
        assert f"{field}=1000000 cannot be greater" in str(refused.value)
        proxy_set = ParsedRequest(
            {field: 100_000}, endpoint, False, "tiny", 1, 100_000, 256, False,
            budget_from_client=False,
        )  # fmt: skip
        proxy_set.keep_output_within(2048)
        assert (proxy_set.max_tokens, proxy_set.body[field]) == (2048, 2048)
    within = ParsedRequest({"max_tokens": 2048}, "chat", False, "tiny", 1, 2048, 2048, False)
    within.keep_output_within(2048)
    assert within.body == {"max_tokens": 2048}


def test_an_adapters_context_is_its_base_models() -> None:
    cards = ({"id": "tiny", "max_model_len": 4096}, {"id": "tiny-lora", "parent": "tiny"})
    assert model_context("tiny-lora", [cards]) == 4096
    assert model_context("tiny-lora", [({"id": "tiny-lora", "parent": "other"},)]) is None
    odd: tuple[dict[str, object], ...] = ({"id": ["x"]}, {"id": "a", "parent": ["tiny"]})
    assert model_context("a", [odd, cards]) is None and model_context("tiny", [odd, cards]) == 4096


async def test_an_adapter_not_listed_yet_is_bounded_by_its_base_models_context() -> None:
    """vLLM lists an adapter's card only once loaded (and without max_model_len): the
    catalogue's base model says its context (red team, stop 50: before its first load a
    tokens_per_minute share went on past it, vLLM's 400; a client's 1,000,000 waited)."""
    backend = FakeVLLM()
    backend.max_model_len = 2048  # the base model's card; the adapter's is never listed here

    async def load(request: web.Request) -> web.Response:
        return web.Response(text="Success")

    app = backend.app()
    app.router.add_post("/v1/load_lora_adapter", load)
    adapters = {"lora-a": {"path": "/adapters/a", "base_model": "tiny", "shared": True}}
    body = {"model": "lora-a", "messages": [{"role": "user", "content": "hello there"}]}
    async with serve_app(app, handler_cancellation=True) as url:
        settings = {"url": url, "max_inflight": 4, "max_loras": 2, "load_adapters": True}
        config = make_config(
            [settings], adapters=adapters, tenants=tenants(tokens_per_minute=100_000)
        )
        async with running_proxy(config) as (base, state), aiohttp.ClientSession() as client:
            for entry in state.pool.all():
                entry.model_cards = CARDS  # the base model's, as probed: no adapter card
            absurd = {**body, "max_tokens": 1_000_000}  # a tenant without limits
            headers = auth("high")
            async with client.post(f"{base}/v1/chat/completions", json=absurd, headers=headers) as r:  # fmt: skip
                answer = await r.json()
                assert r.status == 400 and "max_model_len=2048" in answer["error"]["message"]
            headers = auth("normal")  # tokens_per_minute 100,000: a share past the context
            async with client.post(f"{base}/v1/chat/completions", json=body, headers=headers) as r:  # fmt: skip
                assert r.status == 200, await r.text()
    assert [b.body["max_tokens"] for b in backend.received] == [2048]


def test_chat_runs_max_completion_tokens_whatever_max_tokens_beside_it() -> None:
    """vLLM 0.32's chat takes max_completion_tokens when set (build_tok_params): a max_tokens
    beside it, past the context or the service's ceiling, is not refused (red team, stop 50)."""
    for beside in (5000, 2_000_000):
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": beside}
        raw = orjson.dumps({**body, "max_completion_tokens": 10})
        tier = Tier(priority=0, weight=1, max_queue=10, queue_timeout_s=10, request_timeout_s=60)
        parsed = parse_body(raw, "chat", tier, Limits(), Scheduling())
        parsed.keep_output_within(2048)  # not refused
        assert parsed.max_tokens == 10


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses", "embeddings"])
def test_each_choice_is_billed_its_prompt(endpoint: Endpoint) -> None:
    """vLLM runs a request per choice of ``n``, each prefilling the prompt (all of it with
    ``prompt_logprobs`` or no prefix caching), and counts it once per choice; its usage says it
    once (red team, stop 57: 64 choices ran 33x the tenant's quota): the bill, the reservation
    and the estimates count it once per choice, of every prompt of a list. /v1/responses runs
    one choice whatever ``n`` says (billed 3x what ran, before)."""
    body: dict[str, Any] = {"model": "tiny"}
    if endpoint == "chat":
        body |= {"messages": [{"role": "user", "content": "hi"}], "n": 3}
    elif endpoint == "completions":
        body |= {"prompt": ["one", "two"], "n": 4, "prompt_logprobs": 0}
    else:  # vLLM's Responses (and pooling) models have no n: one run whatever it says
        body |= {"input": "hi", "n": 3}
    tier = Tier(priority=0, weight=1, max_queue=10, queue_timeout_s=10, request_timeout_s=60)
    parsed = parse_body(orjson.dumps(body), endpoint, tier, Limits(), Scheduling())
    choices = {"chat": 3, "completions": 4}.get(endpoint, 1)
    assert parsed.prompt_billed(100) == 100 * choices
    assert parsed.sequences == (choices * 2 if endpoint == "completions" else choices) * (
        endpoint != "embeddings"
    )
