"""Red team of ``backends: kv_aware`` against `tierproxy serve` and two real CPU vLLMs, beyond
placement: requests without prompt blocks, hostile prompt shapes, clients that leave, a proxy
started beside busy engines, and streams vLLM refuses inside the stream. Counts, not times."""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.bench.hostile.served import ServedProxy
from proxy.bench.inproc import KEYS
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import KV_EVENTS
from tests.helpers.kvpair import (
    CHAT,
    KV_EVENTS_B,
    TIMEOUT,
    Client,
    conversation,
    inflight,
    kept_placement,
    kv_pair_config,
    proxy_metrics,
    replay_holds_first_batch,
    system_prompt,
    until_trusted,
)

pytestmark = [pytest.mark.integration, pytest.mark.engines(KV_EVENTS, KV_EVENTS_B)]


@pytest.fixture(scope="module")
def pair(engines: EngineFarm) -> tuple[EngineProcess, EngineProcess]:
    return engines.get(KV_EVENTS), engines.get(KV_EVENTS_B)


async def test_requests_without_prompt_blocks_in_flight_together_all_succeed_and_free_slots(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promises 4 and 5: a request whose prompt has no blocks (``chat_template_kwargs`` or ``tools``, an image, a
    prompt past the context, the /tokenize budget spent: placed by load) is served like any
    other. ``KvInFlight`` keeps an empty per-backend counter for it and drops that counter when
    another flight there ends; the next such request to end there raised ``KeyError`` in the
    chooser's ``ended``: a 500 for an answer the engine computed, and (raised before the pool
    counts it out) its slot never freed, until every backend looks full to every tenant."""
    a, b = pair
    with ServedProxy(kv_pair_config(a, b), tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await until_trusted(session, proxy)

            async def plain(n: int) -> int:
                body = {"model": "tiny", "max_tokens": 24, "ignore_eos": True, "chat_template_kwargs": {},
                        "messages": [{"role": "user", "content": f"hello {n}"}]}  # fmt: skip
                return (await client.post("low", body))[0]

            statuses = await asyncio.gather(*(plain(n) for n in range(16)))
            slots = await inflight(session, proxy)
            assert statuses.count(200) == 16 and slots == [0, 0], (sorted(statuses), slots)


def _hostile_bodies() -> list[tuple[str, dict[str, Any]]]:
    """Odd prompt shapes and fields a client may set, each on its route."""
    comp, chat = "/v1/completions", CHAT
    user = [{"role": "user", "content": "hello"}]
    long_text = "x" * 300_000
    return [
        (comp, {"prompt": [5, 6, 7] * 300}),
        (comp, {"prompt": [-1, 5]}),
        (comp, {"prompt": [2**40, 5]}),
        (comp, {"prompt": [True, False, 7]}),
        (comp, {"prompt": [[5, 6, 7], [8, 9, 10]]}),
        (comp, {"prompt": ["alpha", "beta"]}),
        (comp, {"prompt": ""}),
        (comp, {"prompt": []}),
        (comp, {"prompt": "hi", "echo": True, "logprobs": 2}),
        (comp, {"prompt": "hello " * 100, "truncate_prompt_tokens": 5}),
        (comp, {"prompt": "hello " * 100, "add_special_tokens": False}),
        (comp, {"prompt": "hello", "prompt_embeds": "AAAA"}),
        (comp, {"prompt": "hello", "n": 3, "best_of": 3}),
        (comp, {"prompt": "hello", "prompt_logprobs": 1}),
        (chat, {"messages": []}),
        (chat, {"messages": [{"role": "user"}]}),
        (chat, {"messages": [{"role": "user", "content": None}]}),
        (
            chat,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ]
            },
        ),
        (
            chat,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            }
                        ],
                    }
                ]
            },
        ),
        (chat, {"messages": [{"role": "\u202e\U0001f642", "content": "\u0000\ud7ff\ufeff"}]}),
        (chat, {"messages": [{"role": "user", "content": "hi", "name": "{{ 7*7 }}"}]}),
        (chat, {"messages": [{"role": "user", "content": long_text}]}),
        (chat, {"messages": [{"role": "user", "content": "m"}] * 3000}),
        (chat, {"messages": [{"role": "user", "content": {"nested": ["x"]}}]}),
        (chat, {"messages": user, "n": 4}),
        (chat, {"messages": user, "n": 2, "stream": True}),
        (chat, {"messages": user, "cache_salt": "x"}),
        (chat, {"messages": user, "cache_salt": ["x"]}),
        (chat, {"messages": user, "chat_template": "{{ 'x' * 99999999 }}"}),
        (chat, {"messages": user, "chat_template_kwargs": {"add_generation_prompt": False}}),
        (
            chat,
            {
                "messages": [*user, {"role": "assistant", "content": "ok"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
        ),
        (chat, {"messages": user, "documents": [{"title": "t", "text": "d"}]}),
        (chat, {"messages": user, "mm_processor_kwargs": {"x": 1}}),
        (
            chat,
            {
                "messages": user,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "none",
            },
        ),
        (chat, {"messages": user, "kv_transfer_params": {"do_remote_prefill": True}}),
        (chat, {"messages": user, "max_tokens": 0}),
        (chat, {"messages": user, "max_tokens": 10**12}),
    ]


@pytest.mark.parametrize("local", [True, False], ids=["local-tokenizer", "vllm-tokenize"])
async def test_hostile_prompt_shapes_get_an_answer_and_never_fail_another_tenant(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path, local: bool
) -> None:
    """Promise 4: each odd prompt shape or field gets a 200 or an OpenAI-shaped 4xx, never a
    5xx, while another tenant's requests, sent at the same time, all succeed; every slot comes
    back."""
    a, b = pair
    config = kv_pair_config(a, b)
    if not local:
        config["kv_cache"]["tokenizer"] = None
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await until_trusted(session, proxy)
            headers = {"Authorization": f"Bearer {KEYS['low']}"}

            async def odd(path: str, body: dict[str, Any]) -> tuple[str, int, bytes]:
                full = {"model": "tiny", "max_tokens": 2, **body}
                async with session.post(proxy.url + path, json=full, headers=headers) as r:
                    return f"{path} {sorted(body)}", r.status, await r.read()

            async def calm(n: int) -> int:
                return await client.chat("high", conversation(system_prompt("calm"), n))

            odd_answers, calm_answers = await asyncio.gather(
                asyncio.gather(*(odd(p, body) for p, body in _hostile_bodies())),
                asyncio.gather(*(calm(n) for n in range(12))),
            )
            bad = []
            for name, status, raw in odd_answers:
                if status == 200:
                    continue
                error = orjson.loads(raw).get("error") if raw.startswith(b"{") else None
                if status >= 500 or not isinstance(error, dict) or "message" not in error:
                    bad.append((name, status, raw[:200]))
            assert not bad, bad
            assert len(calm_answers) == 12
            assert await inflight(session, proxy) == [0, 0]


async def _gauges(
    session: aiohttp.ClientSession, pair: tuple[EngineProcess, ...], names: str
) -> float:
    """The engines' own series matching ``names`` (a regex), summed over both."""
    total = 0.0
    for engine in pair:
        async with session.get(engine.spec.url + "/metrics") as resp:
            text = await resp.text()
        for m in re.finditer(rf"^vllm:(?:{names})\{{[^}}]*\}} (\S+)$", text, re.M):
            total += float(m.group(1))
    return total


async def _until_engines_idle(
    session: aiohttp.ClientSession, pair: tuple[EngineProcess, ...]
) -> bool:
    for _ in range(200):  # polls
        if await _gauges(session, pair, "num_requests_running|num_requests_waiting") == 0:
            return True
        await asyncio.sleep(0.1)
    return False


LONG = 1600  # tokens: ~2 s of the tiny model's decoding on an idle core (a 2,048 context)


async def test_a_client_that_leaves_leaves_nothing_running_upstream(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 5: a stream cut after its first chunk, and a non-streaming request whose client
    leaves while the engine generates, are aborted on the engine (it generates fewer tokens
    than asked, by its own counter); every slot comes back. Counted, not sampled: a gauge read
    while the stream runs raced its end on a busy machine."""
    a, b = pair
    generated = "generation_tokens_total"
    with ServedProxy(kv_pair_config(a, b), tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await until_trusted(session, proxy)
            assert await _until_engines_idle(session, pair)
            before = await _gauges(session, pair, generated)
            async with client.running("normal", conversation(system_prompt("cut"), 0)):
                pass  # its first chunk came: the client leaves
            assert await _until_engines_idle(session, pair), "the stream still runs"
            cut = await _gauges(session, pair, generated) - before
            assert 0 < cut < LONG, f"the engine generated {cut} of the cut stream's {LONG}"

            body = {"model": "tiny", "max_tokens": LONG, "ignore_eos": True,
                    "messages": conversation(system_prompt("left"), 0)}  # fmt: skip
            # LONG is near the engines' 2,048-token context: a fast engine can answer within
            # a poll and two scrapes. Such a try left nothing to abort: void, tried again.
            for _ in range(3):
                before = await _gauges(session, pair, generated)
                task = asyncio.create_task(client.post("low", body))
                for _ in range(200):  # polls: until the engine has generated some of it
                    if task.done() or await _gauges(session, pair, generated) > before:
                        break
                    await asyncio.sleep(0.05)
                answered = task.done()
                task.cancel()
                if not answered:
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    break
                assert (await task)[0] == 200
                assert await _until_engines_idle(session, pair)
            assert not answered, "every try was answered before its client left"
            assert await _until_engines_idle(session, pair), "the request still runs"
            left = await _gauges(session, pair, generated) - before
            assert 0 < left < LONG, f"the engine generated {left} of the left request's {LONG}"
            for _ in range(50):
                if await inflight(session, proxy) == [0, 0]:
                    break
                await asyncio.sleep(0.1)
            assert await inflight(session, proxy) == [0, 0]


async def test_a_proxy_started_beside_busy_engines_trusts_them_and_never_overpredicts(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 3: a proxy started beside engines that served traffic before it (through an
    earlier proxy, now gone) reads a trusted index of each within polls of its start, and
    never predicts more cached tokens than the engine reports, for prompts cached before it
    started and after."""
    seen = await _restarted_proxy_predictions(pair, tmp_path)
    predicted, reported, trust = seen.predicted, seen.reported, seen.trust
    over = [(p, r) for p, r in zip(predicted, reported, strict=True) if p is not None and p > r]
    assert not over, f"predicted more cached than vLLM reported: {over}"
    assert all(p is not None for p in predicted), predicted
    assert trust and all(t >= 1 for t in trust), trust


async def test_a_proxy_started_beside_engines_knows_what_they_cached_before_it(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 3 / docs/kv-cache.md: an engine whose whole history is still in its replay
    buffer (vLLM's 10,000 batches) gives a new proxy an exact index, said as trust 2 on its
    /metrics. The replay was asked only when the engine published its next batch: an idle
    engine (or one serving cache hits) never was, and every conversation it held was predicted
    0 and placed as new. Now a silent new connection asks it. An engine that earlier tests
    took past its buffer (the suite shares it) can only be partial: trust 1, and never more
    predicted than vLLM found."""
    seen = await _restarted_proxy_predictions(pair, tmp_path, probe_replay=True)
    exact = seen.exact
    assert exact, "neither engine still buffers its first batch: no exact index to show"
    first = list(zip(seen.predicted[:6], seen.backends[:6], seen.reported[:6], strict=True))
    assert any(u in exact for _, u, _ in first), f"none of the six on {exact}: {first}"
    assert all(p == r if u in exact else p is not None and p <= r for p, u, r in first), (
        f"(predicted, backend, vLLM's cached) per prompt, exact on {exact}: {first}"
    )


@dataclass(frozen=True)
class _Restarted:
    """What the second proxy of ``_restarted_proxy_predictions`` saw, per request: the index's
    prediction (the usage log's; None: no blocks), the backend and vLLM's cached tokens; its
    trust per backend at the end; and the engines whose replay buffer still held their first
    batch when it started (probed only when asked), whose index must be exact."""

    predicted: list[int | None]
    backends: list[str]
    reported: list[int]
    trust: list[float]
    exact: frozenset[str] = frozenset()


async def _restarted_proxy_predictions(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path, *, probe_replay: bool = False
) -> _Restarted:
    """Six prompts sent through a first proxy; then, through a second one started after it
    stopped (its indexes trusted, and exact where ``probe_replay`` found the engine's first
    batch still buffered), those six again, then four new prompts twice."""
    a, b = pair
    before = [conversation(system_prompt(f"early-{secrets.token_hex(4)}"), n) for n in range(6)]
    with ServedProxy(kv_pair_config(a, b), tmp_path / "first").start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            for messages in before:
                await client.chat("normal", messages)
    exact = frozenset(
        [e.spec.url for e in pair if probe_replay and await replay_holds_first_batch(e)]
    )
    config = kv_pair_config(a, b)
    usage_log = tmp_path / "usage.jsonl"
    config["usage_log"] = {"path": str(usage_log)}
    with ServedProxy(config, tmp_path / "second").start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await until_trusted(session, proxy, exact=exact)
            reported = [await client.chat("normal", m) for m in before]
            after = [
                conversation(system_prompt(f"late-{secrets.token_hex(4)}"), n) for n in range(4)
            ]
            for messages in after + after:
                reported.append(await client.chat("normal", messages))
            metrics = await proxy_metrics(session, proxy)
    lines = [orjson.loads(line) for line in usage_log.read_bytes().splitlines()]
    mine = [u for u in lines if u.get("tenant") == "tenant-normal"]
    assert len(mine) == len(reported)
    trust = re.findall(r"^tierproxy_kv_index_trust\{[^}]*\} (\S+)$", metrics, re.M)
    return _Restarted(
        [u.get("predicted_cached_tokens") for u in mine],
        [u.get("backend", "") for u in mine],
        reported,
        [float(t) for t in trust],
        exact,
    )


async def test_streams_the_engine_refused_inside_the_stream_leave_no_placement(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 1: vLLM refuses some requests only once it streams (HTTP 200, then an error
    event of code 400 and [DONE]: ``top_logprobs`` past its ``max_logprobs``, a token id out
    of vocabulary). The engine did no work, yet the relay calls it a backend error, counted as
    run: the chooser keeps the prompts' blocks as placement (``kv_placement`` on
    /admin/status), homes them where they were sent, and notes their prefixes."""
    a, b = pair
    with ServedProxy(kv_pair_config(a, b), tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            await until_trusted(session, proxy)
            before = await kept_placement(session, proxy)
            headers = {"Authorization": f"Bearer {KEYS['low']}"}
            events = []
            for n in range(4):
                body = {"model": "tiny", "max_tokens": 2, "stream": True, "logprobs": True,
                        "top_logprobs": 100, "messages": conversation(system_prompt(f"r{n}"), n)}  # fmt: skip
                async with session.post(proxy.url + CHAT, json=body, headers=headers) as r:
                    events.append((r.status, await r.read()))
            assert all(s == 200 and b'"code": 400' in raw for s, raw in events), events[0]
            after = await kept_placement(session, proxy)
            assert after == before, f"refused streams kept as placement: {before} -> {after}"
