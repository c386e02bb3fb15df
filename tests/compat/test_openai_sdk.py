"""The OpenAI Python SDK, sync and async, through the proxy and directly against the same vLLM:
the same answers (greedy decoding), the same fields, the same stream, and the errors and
retries a client of the proxy meets."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from proxy.bench.inproc import make_config, until
from proxy.config.tenants import hash_key
from tests.helpers.compat import (
    MODEL,
    Sides,
    dump,
    engine,
    finished_requests,
    shape,
    sides,
    summarize_chunks,
    without_volatile,
)
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import LONG_CONTEXT

pytestmark = [pytest.mark.integration, pytest.mark.engines(LONG_CONTEXT)]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]
# Greedy decoding: the same answer from the same engine, whoever asks.
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 1, "max_tokens": 12}


def assert_same(proxy: dict[str, Any], direct: dict[str, Any]) -> None:
    assert shape(proxy) == shape(direct)
    assert without_volatile(proxy) == without_volatile(direct)


async def test_chat_sync_same_answer_and_fields(both: Sides) -> None:
    def ask(client: openai.OpenAI) -> ChatCompletion:
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, seed=1, max_tokens=12
        )

    answers = {s: await asyncio.to_thread(ask, c) for s, c in both.sync_clients().items()}
    assert_same(dump(answers["proxy"]), dump(answers["direct"]))
    assert answers["proxy"].choices[0].finish_reason == "length"
    assert answers["proxy"].usage is not None and answers["proxy"].usage.completion_tokens == 12


async def test_completions_async_same_answer_and_fields(both: Sides) -> None:
    answers = {
        side: await client.completions.create(model=MODEL, prompt="Once upon", **GREEDY)
        for side, client in both.async_clients().items()
    }
    assert_same(dump(answers["proxy"]), dump(answers["direct"]))


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_stream_async_same_chunks(both: Sides, include_usage: bool) -> None:
    summaries = {}
    for side, client in both.async_clients().items():
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            temperature=0,
            seed=1,
            max_tokens=12,
            stream_options={"include_usage": True} if include_usage else openai.omit,
        )
        summaries[side] = summarize_chunks([chunk async for chunk in stream])
    proxy, direct = summaries["proxy"], summaries["direct"]
    assert (proxy.text, proxy.finish, proxy.usage) == (direct.text, direct.finish, direct.usage)
    # Every field the direct stream carries (system_fingerprint, too, without include_usage).
    assert proxy.fields == direct.fields
    assert proxy.chunks_with_usage == direct.chunks_with_usage == (1 if include_usage else 0)


async def test_completions_stream_sync_same_chunks(both: Sides) -> None:
    def run(client: openai.OpenAI) -> Any:
        stream = client.completions.create(
            model=MODEL, prompt="Once upon", stream=True, temperature=0, seed=1, max_tokens=12
        )
        return summarize_chunks(list(stream))

    summaries = {s: await asyncio.to_thread(run, c) for s, c in both.sync_clients().items()}
    assert summaries["proxy"] == summaries["direct"]
    assert summaries["proxy"].finish == {0: "length"}


async def test_n2_and_logprobs_same_choices(both: Sides) -> None:
    answers = {
        side: dump(
            await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                n=2,
                logprobs=True,
                top_logprobs=2,
                # vLLM refuses n > 1 with greedy sampling; a seed makes sampling repeatable.
                temperature=1.0,
                seed=7,
                max_tokens=12,
            )
        )
        for side, client in both.async_clients().items()
    }
    proxy, direct = answers["proxy"], answers["direct"]
    assert shape(proxy) == shape(direct)
    assert [c["index"] for c in proxy["choices"]] == [0, 1]
    assert proxy["usage"] == direct["usage"]
    for mine, theirs in zip(proxy["choices"], direct["choices"], strict=True):
        assert mine["message"]["content"] == theirs["message"]["content"]
        assert mine["finish_reason"] == theirs["finish_reason"]
        tokens = [(t["token"], t["logprob"]) for t in mine["logprobs"]["content"]]
        expected = [(t["token"], t["logprob"]) for t in theirs["logprobs"]["content"]]
        assert [t for t, _ in tokens] == [t for t, _ in expected]
        assert all(
            math.isclose(a, b, abs_tol=1e-3)
            for (_, a), (_, b) in zip(tokens, expected, strict=True)
        )


async def test_json_schema_response_format_same_answer(both: Sides) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "pick", "schema": schema, "strict": True},
    }
    answers = {
        side: dump(
            await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                response_format=response_format,
                temperature=0,
                max_tokens=64,
            )
        )
        for side, client in both.async_clients().items()
    }
    assert_same(answers["proxy"], answers["direct"])
    choice = answers["proxy"]["choices"][0]
    if choice["finish_reason"] == "stop":  # the grammar closed the object within max_tokens
        assert json.loads(choice["message"]["content"])["color"] in ("red", "blue")


async def test_raw_response_headers_carry_the_request_id(both: Sides) -> None:
    client = both.async_clients()["proxy"]
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, **GREEDY
    )
    assert raw.status_code == 200 and raw.headers.get("x-request-id")
    assert raw.parse().choices[0].finish_reason == "length"
    # Streamed answers too (the SDK's `_request_id` reads this header).
    streamed = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, stream=True, max_tokens=12
    )
    assert streamed.headers.get("x-request-id")
    async for _ in streamed.parse():
        pass
    # A client's own well-formed id is honoured.
    mine = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, extra_headers={"X-Request-Id": "compat-0123"}, **GREEDY
    )
    assert mine.headers.get("x-request-id") == "compat-0123"


async def test_401_and_404_as_the_sdk_expects(both: Sides) -> None:
    attempts: list[object] = []

    async def count(request: object) -> None:
        attempts.append(request)

    bad_key = openai.AsyncOpenAI(
        base_url=f"{both.proxy}/v1",
        api_key="wrong",
        max_retries=2,
        http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [count]}),
    )
    with pytest.raises(openai.AuthenticationError) as unauthorized:
        await bad_key.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert unauthorized.value.status_code == 401
    assert len(attempts) == 1  # the SDK does not retry a 401
    errors = {}
    for side, client in both.async_clients().items():
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="no-such", messages=MESSAGES, max_tokens=4)
        errors[side] = missing.value
    assert errors["proxy"].status_code == errors["direct"].status_code == 404
    assert isinstance(errors["proxy"].body, dict) and isinstance(errors["direct"].body, dict)
    assert set(errors["proxy"].body) == set(errors["direct"].body)


async def test_429_503_504_and_the_sdks_retries(engines: EngineFarm) -> None:
    """The SDK retries 429 and 503 (twice by default, after Retry-After) and must not retry a
    504 that ran the tier's whole execution timeout (`x-should-retry: false`)."""
    tenants = make_config([])["tenants"] + [
        {"name": n, "tier": t, "keys": [{"sha256": hash_key(k)}], **extra}
        for n, t, k, extra in (
            ("solo", "high", "key-solo", {"max_concurrent": 1}),
            ("brief", "brief", "key-brief", {}),
            ("hasty", "hasty", "key-hasty", {}),
        )
    ]
    tier = {"weight": 1, "max_queue": 10, "queue_timeout_s": 60, "request_timeout_s": 60}
    tiers = {
        "brief": {**tier, "priority": 0, "queue_timeout_s": 0.3},
        "hasty": {**tier, "priority": 0, "request_timeout_s": 1},
    }
    eng = engine(engines)
    async with sides(eng, max_inflight=1, tiers=tiers, tenants=tenants) as both:

        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=f"{both.proxy}/v1", api_key=key, max_retries=2)

        # The backend drained: nothing is dispatched, so the queued solo request keeps its
        # tenant's one concurrent request and the brief ones wait out their queue timeout
        # for as long as the rounds take, whatever the engine's speed (a long generation as
        # the holder ended first on a fast machine, and a retry passed).
        url = both.state.pool.all()[0].cfg.url
        both.state.pool.drain(url)
        holder = asyncio.create_task(
            client("key-solo").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        )
        try:
            await until(lambda: both.state.limits.concurrent("solo") == 1, what="solo's request")
            before = finished_requests(both.state)
            with pytest.raises(openai.RateLimitError) as limited:
                await client("key-solo").chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4
                )
            assert limited.value.response.headers.get("retry-after")
            assert finished_requests(both.state) - before == 3  # 1 + the SDK's 2 retries
            before = finished_requests(both.state)
            with pytest.raises(openai.InternalServerError) as overloaded:
                await client("key-brief").chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4
                )
            assert overloaded.value.status_code == 503
            assert finished_requests(both.state) - before == 3
            assert not holder.done()  # it held solo's slot throughout
        finally:
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            both.state.pool.drain(url, False)
        await until(lambda: not both.state.limits.concurrent("solo"), what="solo's slot freed")
        before = finished_requests(both.state)
        with pytest.raises(openai.APIStatusError) as timed_out:
            await client("key-hasty").chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=16000, extra_body={"ignore_eos": True}
            )
        assert timed_out.value.status_code == 504
        assert timed_out.value.response.headers.get("x-should-retry") == "false"
        assert finished_requests(both.state) - before == 1  # each retry would cost the GPU again


async def test_responses_sync_and_stream_same_answer(both: Sides) -> None:
    """/v1/responses, as vLLM serves it."""
    answers = {
        side: dump(
            await asyncio.to_thread(
                client.responses.create,
                model=MODEL,
                input="Say something.",
                max_output_tokens=12,
                temperature=0,
            )
        )
        for side, client in both.sync_clients().items()
    }
    assert shape(answers["proxy"]) == shape(answers["direct"])
    for key in ("status", "output", "usage", "incomplete_details"):
        assert without_volatile(answers["proxy"].get(key)) == without_volatile(
            answers["direct"].get(key)
        ), key
    events: dict[str, list[str]] = {}
    texts: dict[str, str] = {}
    for side, aclient in both.async_clients().items():
        stream = await aclient.responses.create(
            model=MODEL, input="Say something.", max_output_tokens=12, temperature=0, stream=True
        )
        seen = [event async for event in stream]
        # The kinds of event in order, a run of deltas as one: how many tokens vLLM puts in one
        # delta depends on its timing (it merges them under load), not on the route taken.
        events[side] = [e.type for i, e in enumerate(seen) if i == 0 or e.type != seen[i - 1].type]
        texts[side] = "".join(getattr(e, "delta", "") for e in seen if e.type.endswith(".delta"))
    assert events["proxy"] == events["direct"] and texts["proxy"] == texts["direct"]
    assert events["proxy"][-1] in ("response.completed", "response.incomplete")
