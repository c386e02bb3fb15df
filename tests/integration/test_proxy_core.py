"""The proxy core against real stock vLLM (CPU, tiny model, --max-num-seqs 4 to saturate)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from proxy.bench.inproc import auth, make_config, running_proxy, until
from proxy.bench.scrape import wait_idle
from proxy.config.tenants import hash_key
from proxy.relay import sse
from proxy.telemetry import prometheus
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import LONG_CONTEXT

pytestmark = [pytest.mark.integration, pytest.mark.engines(LONG_CONTEXT)]
# The tiny model's whole context: a "long" request then holds its slot for 15 s or more even on
# a quiet machine (the tiny model generates ~900 tokens/s), so tests do not race it. Tests
# close such holders rather than wait for them.
LONG_TOKENS = 16000
TIMEOUT = aiohttp.ClientTimeout(total=120)


def _chat(max_tokens: int, stream: bool = False, content: str = "hello") -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _finished_when_idle(
    session: aiohttp.ClientSession, url: str, timeout_s: float = 120.0
) -> float:
    """vLLM's count of requests it finished normally, once nothing runs or waits there (1 s).

    A request whose client left is aborted by vLLM and never counted here; one that vLLM
    kept generating finishes later with reason "length" and is. (vLLM's generated-token
    counter cannot tell: it skips the tokens of aborted requests.)"""
    text = await wait_idle(session, url, timeout_s=timeout_s, settle_s=1.0)
    assert text is not None, "vLLM kept working: a request the proxy gave up on still runs"
    return prometheus.total(text, "vllm:request_success_total")


async def _stream_timed(
    session: aiohttp.ClientSession, base: str, tier: str, body: dict[str, Any]
) -> dict[str, Any]:
    start = time.monotonic()
    first = None
    tokens = 0  # from the final usage chunk (vLLM may merge several tokens into one chunk)
    async with session.post(f"{base}/v1/chat/completions", json=body, headers=auth(tier)) as r:
        status = r.status
        async for data in sse.data_of(r):
            if data.startswith(b"{"):
                event = orjson.loads(data)
                if event.get("choices") and first is None:
                    first = time.monotonic()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return {
        "status": status,
        "ttft_at": first,
        "done_at": time.monotonic(),
        "start": start,
        "tokens": tokens,
    }


async def test_high_tier_overtakes_40_queued_low_requests(engines: EngineFarm) -> None:
    engine = engines.get(LONG_CONTEXT)
    cfg = make_config([{"url": engine.spec.url, "max_inflight": 4}])
    async with running_proxy(cfg) as (base, state), aiohttp.ClientSession(timeout=TIMEOUT) as s:
        # Four long streams hold every slot while the backlog of 40 queues, then the high comes
        # (a fast engine ran the short lows as fast as they came: no backlog of 30 to overtake).
        url = f"{base}/v1/chat/completions"
        body = _chat(LONG_TOKENS, stream=True)
        holders = [await s.post(url, json=body, headers=auth("low")) for _ in range(4)]
        for holder in holders:
            await holder.content.readline()
        lows = [
            asyncio.create_task(_stream_timed(s, base, "low", _chat(48, stream=True)))
            for _ in range(40)
        ]
        await until(lambda: state.queue.depth("low") == 40, what="40 queued lows", state=state)
        high_task = asyncio.create_task(_stream_timed(s, base, "high", _chat(8, stream=True)))
        backend = state.pool.all()[0]
        await until(
            lambda: state.queue.depth("high") + backend.best_inflight == 1,
            what="the high queued or running",
            state=state,
        )
        for holder in holders:  # their clients leave: the slots free one by one
            holder.close()
        high = await high_task
        low_results = await asyncio.gather(*lows)
    assert high["status"] == 200 and high["ttft_at"] is not None
    assert [(r["status"], r["tokens"]) for r in low_results] == [(200, 48)] * 40
    finished_before_high = sum(1 for r in low_results if r["done_at"] < high["ttft_at"])
    # The high request runs at once or at the first slot to free, not after the backlog of 40.
    assert finished_before_high <= 8, finished_before_high
    assert max(r["done_at"] for r in low_results) > high["done_at"]


async def test_queue_full_is_an_immediate_429_and_no_tenant_locks_others_out(
    engines: EngineFarm,
) -> None:
    engine = engines.get(LONG_CONTEXT)
    tenants = make_config([])["tenants"] + [
        {"name": "batch-b", "tier": "low", "keys": [{"sha256": hash_key("key-batch-b")}]}
    ]
    cfg = make_config(
        [{"url": engine.spec.url, "max_inflight": 1}],
        tiers={"low": {"max_queue": 3}},
        tenants=tenants,
    )
    async with running_proxy(cfg) as (base, state), aiohttp.ClientSession(timeout=TIMEOUT) as s:

        async def post(max_tokens: int, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
            async with s.post(
                f"{base}/v1/chat/completions", json=_chat(max_tokens), headers=headers
            ) as r:
                return r.status, await r.json()

        # One long request holds the only slot; three more of one tenant wait (the cap).
        holder = await s.post(
            f"{base}/v1/chat/completions", json=_chat(LONG_TOKENS, stream=True), headers=auth("low")
        )
        await holder.content.readline()
        started = [asyncio.create_task(post(8, auth("low"))) for _ in range(3)]
        await until(
            lambda: state.queue.depth("low") == 3, what="3 queued low requests", state=state
        )
        async with s.post(f"{base}/v1/chat/completions", json=_chat(4), headers=auth("low")) as r:
            body = await r.json()
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
        # Refused at admission, not queued: queue_full is decided before any wait (a wall-clock
        # bound here raced the engine for the machine's two cores).
        assert state.queue.depth("low") == 3
        assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"
        # Another tenant of the full tier still gets in: the tenant holding the whole queue
        # loses its newest request (a 429 for that client) instead.
        other = asyncio.create_task(post(4, {"Authorization": "Bearer key-batch-b"}))
        await until(lambda: any(t.done() for t in started), 5, "a request displaced", state)
        assert state.queue.depth("low") == 3
        holder.close()  # the slot frees: the queued requests run
        # Another tier is not affected by the low tier's cap.
        async with s.post(f"{base}/v1/chat/completions", json=_chat(2), headers=auth("high")) as r:
            assert r.status == 200
        results = await asyncio.gather(*started)
        assert sorted(status for status, _ in results) == [200, 200, 429]
        displaced = next(body for status, body in results if status == 429)
        assert displaced["error"]["code"] == "queue_full"
        assert "largest share" in displaced["error"]["message"]
        assert (await other)[0] == 200
        assert len(state.queue) == 0


async def test_queue_timeout_503_and_execution_timeout_504(engines: EngineFarm) -> None:
    engine = engines.get(LONG_CONTEXT)
    cfg = make_config(
        [{"url": engine.spec.url, "max_inflight": 1}],
        tiers={"low": {"queue_timeout_s": 0.5, "request_timeout_s": 0.5}},
    )
    async with running_proxy(cfg) as (base, state), aiohttp.ClientSession(timeout=TIMEOUT) as s:
        # A long normal-tier generation holds the only slot; a low request waits past its
        # 0.5 s in the queue: 503 with Retry-After.
        holder = await s.post(
            f"{base}/v1/chat/completions",
            json=_chat(LONG_TOKENS, stream=True),
            headers=auth("normal"),
        )
        await holder.content.readline()
        async with s.post(f"{base}/v1/chat/completions", json=_chat(4), headers=auth("low")) as r:
            body = await r.json()
            assert r.status == 503, body
            assert body["error"]["code"] == "queue_timeout" and "Retry-After" in r.headers
        holder.close()
        await until(lambda: state.pool.all()[0].inflight == 0, what="the holder gone", state=state)
        before = await _finished_when_idle(s, engine.spec.url)  # the holder is gone too

        # A long low-tier generation outlives the tier's 0.5 s execution limit: 504.
        async with s.post(
            f"{base}/v1/chat/completions", json=_chat(LONG_TOKENS), headers=auth("low")
        ) as r:
            body = await r.json()
            assert r.status == 504 and body["error"]["code"] == "request_timeout"
        # And vLLM stopped working on it: the proxy closed the connection, vLLM aborted it
        # (had it gone on, it would have finished and counted it within a minute).
        assert await _finished_when_idle(s, engine.spec.url) == before

        # Streaming: the timeout arrives as an error event, then [DONE]. A try whose first
        # event vLLM did not send within the 0.5 s (a busy machine) is a 504 before any stream
        # began: void, tried again (a few times at most).
        for _ in range(3):
            async with s.post(
                f"{base}/v1/chat/completions",
                json=_chat(LONG_TOKENS, stream=True),
                headers=auth("low"),
            ) as r:
                raw = await r.read()
            if r.status != 504:
                break
        assert r.status == 200, f"every try timed out before vLLM's first event: {raw!r}"
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]"
        assert b'"request_timeout"' in events[-2]
        assert await _finished_when_idle(s, engine.spec.url) == before
        assert len(state.queue) == 0 and state.pool.all()[0].inflight == 0


async def test_client_leaving_mid_stream_or_in_queue_frees_everything(engines: EngineFarm) -> None:
    engine = engines.get(LONG_CONTEXT)
    cfg = make_config(
        [{"url": engine.spec.url, "max_inflight": 1}],
        admin_keys=[{"sha256": hash_key("admin-key")}],  # /metrics needs one
    )
    async with running_proxy(cfg) as (base, state), aiohttp.ClientSession(timeout=TIMEOUT) as s:
        before = await _finished_when_idle(s, engine.spec.url)
        leaver = aiohttp.ClientSession(timeout=TIMEOUT)
        r = await leaver.post(
            f"{base}/v1/chat/completions",
            json=_chat(LONG_TOKENS, stream=True),
            headers=auth("normal"),
        )
        await r.content.readline()  # bytes are flowing: vLLM is generating for this client
        queued = asyncio.create_task(
            leaver.post(f"{base}/v1/chat/completions", json=_chat(8), headers=auth("normal"))
        )
        await until(
            lambda: state.queue.depth("normal") == 1, what="one queued request", state=state
        )
        await leaver.close()  # both clients vanish
        queued.cancel()
        # vLLM aborted the streaming request: it never finished it (its own counter)...
        assert await _finished_when_idle(s, engine.spec.url) == before
        # ...and the proxy holds nothing for either client.
        await until(
            lambda: not len(state.queue) and not state.pool.all()[0].inflight,
            5,
            "queue and backend slots to empty",
        )
        async with s.get(f"{base}/metrics", headers={"Authorization": "Bearer admin-key"}) as m:
            text = await m.text()
        assert 'tierproxy_requests_total{outcome="client_gone",tier="normal"} 2.0' in text


async def test_openai_sdk_works_unchanged_and_sees_retryable_errors(engines: EngineFarm) -> None:
    engine = engines.get(LONG_CONTEXT)
    cfg = make_config(
        [{"url": engine.spec.url, "max_inflight": 1}],
        tiers={"low": {"max_queue": 1, "queue_timeout_s": 3}},
    )
    async with running_proxy(cfg) as (base, state):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="key-high", max_retries=0)
        reply = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
        comp = await client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert comp.choices[0].text is not None
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]

        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(
                base_url=f"{base}/v1", api_key="wrong", max_retries=0
            ).models.list()

        low = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="key-low", max_retries=0)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            # A long stream from another tier holds the only slot...
            holder = await s.post(
                f"{base}/v1/chat/completions",
                json=_chat(LONG_TOKENS, stream=True),
                headers=auth("normal"),
            )
            await holder.content.readline()
            # ...one low request waits (the low queue holds one)...
            waiting = asyncio.create_task(
                low.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
            )
            await until(
                lambda: state.queue.depth("low") == 1, what="one queued low request", state=state
            )
            with pytest.raises(openai.RateLimitError):  # ...so the next is refused: 429
                await low.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
            with pytest.raises(openai.InternalServerError) as exc:  # queue timeout: 503
                await waiting
            assert exc.value.status_code == 503
            holder.close()
        await client.close()
        await low.close()


async def test_bad_input_and_unknown_paths(engines: EngineFarm) -> None:
    engine = engines.get(LONG_CONTEXT)
    cfg = make_config(
        [{"url": engine.spec.url, "max_inflight": 4}], limits={"max_body_bytes": 2000}
    )
    async with running_proxy(cfg) as (base, state), aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await until(
            lambda: "tiny" in (state.pool.all()[0].models or ()), what="its models", state=state
        )
        cases = [
            (b"{", 400, "invalid_json"),
            (orjson.dumps({**_chat(5), "max_tokens": -3}), 400, None),
            (orjson.dumps({**_chat(5), "content": "x" * 5000}), 413, "request_too_large"),
            (orjson.dumps({**_chat(5), "model": "nope"}), 404, "model_not_found"),
        ]
        for raw, status, code in cases:
            async with s.post(f"{base}/v1/chat/completions", data=raw, headers=auth("high")) as r:
                body = await r.json()
                assert r.status == status, body
                assert set(body["error"]) == {"message", "type", "param", "code"}
                if code:
                    assert body["error"]["code"] == code
        async with s.post(f"{base}/v1/audio/speech", json={}, headers=auth("high")) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_url"
        async with s.get(f"{base}/readyz") as r:
            assert r.status == 200
        # A max_tokens past max_model_len: vLLM's 400, answered by the proxy from the
        # engine's card before it queues (nothing sent, nothing left in flight).
        big = _chat(LONG_TOKENS + 1000, content="hi")
        async with s.post(f"{base}/v1/chat/completions", json=big, headers=auth("high")) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and "cannot be greater than max_model_len" in error["message"]
        assert len(state.queue) == 0 and state.pool.all()[0].inflight == 0
