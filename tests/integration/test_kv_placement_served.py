"""Red team of ``backends: kv_aware``'s placement promises against `tierproxy serve` (a
subprocess) in front of two real CPU vLLMs (prefix caching, KV events, blocks of 32).

Where a request went is read from the engines themselves: each engine's own
``vllm:request_success_total`` and the answer's ``usage.prompt_tokens_details.cached_tokens``
(an engine that never saw a tenant's salt reports 0). Nothing is timed: counts only.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.bench.hostile.served import ADMIN_KEY, ServedProxy, admin_sections
from proxy.bench.inproc import KEYS, make_config
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import KV_EVENTS, EngineSetting

# A second engine like KV_EVENTS (its own ports, its own cache).
KV_EVENTS_B = EngineSetting("prefix-cache-b", plugin=True, kv_events=True, env=KV_EVENTS.env)
pytestmark = [pytest.mark.integration, pytest.mark.engines(KV_EVENTS, KV_EVENTS_B)]
BLOCK = 32
CHAT = "/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def pair(engines: EngineFarm) -> tuple[EngineProcess, EngineProcess]:
    return engines.get(KV_EVENTS), engines.get(KV_EVENTS_B)


def _config(a: EngineProcess, b: EngineProcess, **extra: Any) -> dict[str, Any]:
    backends = [{"url": e.spec.url, "max_inflight": 4} for e in (a, b)]
    return make_config(
        backends,
        kv_cache={"enabled": True, "tokenizer": a.spec.model, "block_size": BLOCK},
        policies={"backends": "kv_aware"},
        **admin_sections(),
        **extra,
    )


async def _served(session: aiohttp.ClientSession, engine: EngineProcess) -> float:
    """The engine's own count of requests it finished."""
    async with session.get(engine.spec.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    )


async def _metrics(session: aiohttp.ClientSession, proxy: ServedProxy) -> str:
    async with session.get(proxy.admin_url + "/metrics") as resp:
        return await resp.text()


async def _ready(session: aiohttp.ClientSession, proxy: ServedProxy) -> None:
    """Both backends' indexes trusted (``tierproxy_kv_index_trust`` >= 1), counted in polls."""
    for _ in range(300):
        text = await _metrics(session, proxy)
        trust = re.findall(r"^tierproxy_kv_index_trust\{[^}]*\} (\S+)$", text, re.M)
        if len(trust) == 2 and all(float(t) >= 1 for t in trust):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"indexes never trusted: {trust}")


class Client:
    def __init__(self, session: aiohttp.ClientSession, proxy: ServedProxy) -> None:
        self.session, self.proxy = session, proxy

    async def post(self, tier: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {KEYS[tier]}"}
        async with self.session.post(self.proxy.url + CHAT, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def chat(self, tier: str, messages: list[dict[str, str]], **extra: Any) -> int:
        """vLLM's cached prompt tokens of one chat turn that must succeed."""
        body = {"model": "tiny", "messages": messages, "max_tokens": 1, **extra}
        status, answer = await self.post(tier, body)
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    @asynccontextmanager
    async def running(self, tier: str, messages: list[dict[str, str]]) -> AsyncIterator[None]:
        """A long generation of ``messages``, streaming: inside, its first chunk has arrived
        (it runs on an engine); on leaving, the client closes it."""
        body = {"model": "tiny", "messages": messages, "max_tokens": 1600, "ignore_eos": True}
        body["stream"] = True
        headers = {"Authorization": f"Bearer {KEYS[tier]}"}
        async with self.session.post(self.proxy.url + CHAT, json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            await r.content.readline()
            yield


def _system(tag: str) -> str:
    """A system prompt of ~300 tokens no other shares (its tag first)."""
    return f"{tag} " + " ".join(f"rule{i % 97}" for i in range(150))


def _conversation(system: str, n: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"q{n}?"}]


async def test_unattacked_a_tenants_new_conversation_starts_on_its_system_prompts_engine(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """The control of the test below: the same scene without the refused flood."""
    assert await _new_conversation_after_refused_flood(pair, tmp_path, refused=0) >= 8 * BLOCK


async def test_requests_the_engine_refused_do_not_move_another_tenants_prefix_home(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    cached = await _new_conversation_after_refused_flood(pair, tmp_path, refused=40)
    assert cached >= 8 * BLOCK, (
        f"the victim's new conversation found {cached} tokens cached: moved off its"
        " system prompt's engine by requests that never ran"
    )


async def test_another_tenants_repeated_prompt_does_not_move_a_tenants_prefix_home(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 2, the same scene with the attacker's 40 requests run (one prompt of its own,
    repeated: it fills no cache). The balance rule counts every tenant's prompt blocks sent
    lately alike, so one tenant's traffic on an engine moves another tenant's prefix home."""
    cached = await _new_conversation_after_refused_flood(pair, tmp_path, refused=40, ran=True)
    assert cached >= 8 * BLOCK, f"moved off its system prompt's engine: {cached} cached"


async def _new_conversation_after_refused_flood(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path, refused: int, *, ran: bool = False
) -> int:
    """Promise 1: a request the engine refuses (400) leaves every tenant's placement as it was.

    The victim (tenant-normal) has a system prompt cached on one engine (its home) and starts
    its conversations there. The attacker (tenant-low) sends prompts vLLM refuses with a 400
    (a negative temperature), all to that engine (its own prompt's home): they never run, yet
    they count as "prompt blocks sent lately" there, so the balance rule judges the victim's
    home over its share and its next new conversation starts on the other engine, recomputing
    the system prompt (vLLM reports 0 cached tokens), and the prefix's home moves there."""
    a, b = pair
    with ServedProxy(_config(a, b), tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await _ready(session, proxy)
            system = _system(f"victim-{secrets.token_hex(4)}")
            counts = [await _served(session, e) for e in pair]
            for n in range(3):
                await client.chat("normal", _conversation(system, n))
            after = [await _served(session, e) for e in pair]
            deltas = [x - y for x, y in zip(after, counts, strict=True)]
            assert sorted(deltas) == [0, 3], f"the victim's conversations scattered: {deltas}"
            home = pair[deltas.index(3)]
            # The attacker's own prompt, placed on the victim's home (tries: its first
            # placement goes by room and balance; an attacker can try until one lands there).
            mine: list[dict[str, str]] | None = None
            for _ in range(6):
                prompt = _conversation(_system(f"attacker-{secrets.token_hex(4)}"), 0)
                before = await _served(session, home)
                await client.chat("low", prompt)
                if await _served(session, home) > before:
                    mine = prompt
                    break
            assert mine is not None, "no attacker prompt landed on the victim's home"
            # The flood: requests vLLM refuses before any work (temperature -1).
            bad = {"model": "tiny", "messages": mine, "max_tokens": 1, "temperature": -1}
            if ran:  # ``ran``: the same flood, run (its own prompt again: no new cache)
                del bad["temperature"]
            answers = await asyncio.gather(*(client.post("low", bad) for _ in range(refused)))
            assert all(status == (200 if ran else 400) for status, _ in answers), answers[:2]
            # The victim goes on: one of its conversations generating at home, a new one
            # under the same system prompt starts. Its home holds the system prompt.
            async with client.running("normal", _conversation(system, 1)):
                return await client.chat("normal", _conversation(system, 9))


async def _turns(client: Client, system: str, turns: int) -> list[int]:
    """One conversation's turns, each the whole history so far plus a question: per turn, the
    history tokens the engine had to compute again (the previous turn's full blocks it did not
    find cached). A conversation that stays on its engine loses none."""
    messages = [{"role": "system", "content": system}]
    lost: list[int] = []
    previous = 0
    for n in range(turns):
        messages.append({"role": "user", "content": f"question {n} " + "why " * 20})
        body = {"model": "tiny", "messages": messages, "max_tokens": 1}
        status, answer = await client.post("normal", body)
        assert status == 200, answer
        usage = answer["usage"]
        lost.append(max(0, previous - int(usage["prompt_tokens_details"]["cached_tokens"])))
        previous = (usage["prompt_tokens"] - 1) // BLOCK * BLOCK  # its full blocks, as cached
        messages.append({"role": "assistant", "content": f"answer {n}"})
    return lost


async def test_one_tenants_burst_cannot_take_the_remote_tokenize_budget_from_others(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    await _burst_of_prompts_past_the_context(pair, tmp_path, local=False)


async def test_one_tenants_prompts_past_the_context_do_not_move_another_tenants_turns(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 1, with the local tokenizer (no /tokenize call): the same burst. Each prompt
    past the context has no blocks, so the chooser counts its prefill as its prompt's upper
    bound (its bytes: ~200k tokens) queued on its engine until vLLM's 400 comes back; against
    that "work", the victim's turn leaves the engine that holds its history."""
    await _burst_of_prompts_past_the_context(pair, tmp_path, local=True)


async def _burst_of_prompts_past_the_context(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path, *, local: bool
) -> None:
    """Promise 2 (and 1): without a local tokenizer (the default) each request's blocks come
    from a backend's /tokenize, at most ``max_remote_tokenize`` (16) calls in flight for the
    whole process, first come first served; past it a request gets no blocks and is placed by
    load alone. One tenant keeping 24 long prompts in flight (past the model's context: vLLM
    refuses every one with a 400, no engine work) holds that budget, and another tenant's
    conversation turns go without blocks: off the engine that holds their history."""
    a, b = pair
    config = _config(a, b)
    if not local:
        config["kv_cache"]["tokenizer"] = None  # vLLM's /tokenize: the default
    usage_log = tmp_path / "usage.jsonl"
    config["usage_log"] = {"path": str(usage_log)}
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await _ready(session, proxy)
            quiet = await _turns(client, _system(f"calm-{secrets.token_hex(4)}"), 6)
            assert not any(quiet[1:]), f"a conversation lost its history unattacked: {quiet}"
            stop = asyncio.Event()
            refused: list[int] = []

            async def flood() -> None:
                text = "lorem ipsum dolor sit amet " * 8000  # ~48k tokens: past the context
                while not stop.is_set():
                    body = {"model": "tiny", "max_tokens": 1,
                            "messages": [{"role": "user", "content": f"{secrets.token_hex(4)} {text}"}]}  # fmt: skip
                    status, _ = await client.post("low", body)
                    refused.append(status)

            workers = [asyncio.create_task(flood()) for _ in range(24)]
            try:
                while len(refused) < 24:  # every worker's first request answered: in full swing
                    await asyncio.sleep(0.05)
                attacked = await _turns(client, _system(f"victim-{secrets.token_hex(4)}"), 6)
            finally:
                stop.set()
                await asyncio.gather(*workers)
            assert refused and all(s == 400 for s in refused), sorted(set(refused))
        # The index's prediction per victim turn: null where the turn had no blocks.
        lines = [orjson.loads(line) for line in usage_log.read_bytes().splitlines()]
        predicted = [u.get("predicted_cached_tokens") for u in lines if u.get("tenant") == "tenant-normal"]  # fmt: skip
        assert not any(attacked[1:]), (
            f"history tokens computed again per turn under another tenant's burst: {attacked};"
            f" predicted cached tokens per turn (null: no blocks): {predicted}"
        )


async def _inflight(session: aiohttp.ClientSession, proxy: ServedProxy) -> list[int]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.get(proxy.admin_url + "/admin/backends", headers=headers) as resp:
        return [int(b["inflight"]) for b in (await resp.json())["backends"]]


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
    with ServedProxy(_config(a, b), tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await _ready(session, proxy)

            async def plain(n: int) -> int:
                body = {"model": "tiny", "max_tokens": 24, "ignore_eos": True, "chat_template_kwargs": {},
                        "messages": [{"role": "user", "content": f"hello {n}"}]}  # fmt: skip
                return (await client.post("low", body))[0]

            statuses = await asyncio.gather(*(plain(n) for n in range(16)))
            inflight = await _inflight(session, proxy)
            assert statuses.count(200) == 16 and inflight == [0, 0], (sorted(statuses), inflight)


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
    config = _config(a, b)
    if not local:
        config["kv_cache"]["tokenizer"] = None
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await _ready(session, proxy)
            headers = {"Authorization": f"Bearer {KEYS['low']}"}

            async def odd(path: str, body: dict[str, Any]) -> tuple[str, int, bytes]:
                full = {"model": "tiny", "max_tokens": 2, **body}
                async with session.post(proxy.url + path, json=full, headers=headers) as r:
                    return f"{path} {sorted(body)}", r.status, await r.read()

            async def calm(n: int) -> int:
                return await client.chat("high", _conversation(_system("calm"), n))

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
            assert await _inflight(session, proxy) == [0, 0]


async def _running(session: aiohttp.ClientSession, pair: tuple[EngineProcess, ...]) -> float:
    """Requests the engines run or queue now, by their own gauges."""
    total = 0.0
    for engine in pair:
        async with session.get(engine.spec.url + "/metrics") as resp:
            text = await resp.text()
        for m in re.finditer(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M):
            total += float(m.group(1))
    return total


async def _until_engines(
    session: aiohttp.ClientSession, pair: tuple[EngineProcess, ...], busy: bool
) -> bool:
    for _ in range(200):  # polls
        if (await _running(session, pair) > 0) == busy:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_client_that_leaves_leaves_nothing_running_upstream(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 5: a stream cut after its first chunk, and a non-streaming request whose client
    leaves while the engine generates, are aborted on the engine; every slot comes back."""
    a, b = pair
    with ServedProxy(_config(a, b), tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await _ready(session, proxy)
            assert await _until_engines(session, pair, busy=False)
            async with client.running("normal", _conversation(_system("cut"), 0)):
                assert await _running(session, pair) >= 1
            assert await _until_engines(session, pair, busy=False), "the stream still runs"
            body = {"model": "tiny", "max_tokens": 1600, "ignore_eos": True,
                    "messages": _conversation(_system("left"), 0)}  # fmt: skip
            task = asyncio.create_task(client.post("low", body))
            assert await _until_engines(session, pair, busy=True)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await _until_engines(session, pair, busy=False), "the request still runs"
            for _ in range(50):
                if await _inflight(session, proxy) == [0, 0]:
                    break
                await asyncio.sleep(0.1)
            assert await _inflight(session, proxy) == [0, 0]


async def test_a_proxy_started_beside_busy_engines_trusts_them_and_never_overpredicts(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 3: a proxy started beside engines that served traffic before it (through an
    earlier proxy, now gone) reads a trusted index of each within polls of its start, and
    never predicts more cached tokens than the engine reports, for prompts cached before it
    started and after."""
    predicted, reported, trust = await _restarted_proxy_predictions(pair, tmp_path)
    over = [(p, r) for p, r in zip(predicted, reported, strict=True) if p is not None and p > r]
    assert not over, f"predicted more cached than vLLM reported: {over}"
    assert all(p is not None for p in predicted), predicted
    assert trust and all(t >= 1 for t in trust), trust


async def test_a_proxy_started_beside_engines_knows_what_they_cached_before_it(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 3 / docs/kv-cache.md: an engine whose whole history is still in its replay
    buffer (far fewer than 10,000 batches here) gives a new proxy an exact index. The replay
    is asked only when the engine publishes its next batch: until then the trusted (1) index
    holds nothing (``tierproxy_kv_index_blocks`` 0), every conversation already cached is
    predicted 0 and placed as new; an engine that stores nothing new (only cache hits, or
    idle) is never replayed."""
    predicted, reported, _ = await _restarted_proxy_predictions(pair, tmp_path)
    first = list(zip(predicted[:6], reported[:6], strict=True))
    assert all(p == r for p, r in first), f"(predicted, vLLM's cached) per prompt: {first}"


async def _restarted_proxy_predictions(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> tuple[list[int | None], list[int], list[float]]:
    """Six prompts sent through a first proxy; then, through a second one started after it
    stopped (its indexes trusted), those six again, then four new prompts twice. Per request of
    the second proxy: the index's prediction (the usage log's; None: no blocks) and vLLM's
    cached tokens; and the second proxy's trust per backend at the end."""
    a, b = pair
    before = [_conversation(_system(f"early-{secrets.token_hex(4)}"), n) for n in range(6)]
    with ServedProxy(_config(a, b), tmp_path / "first").start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            for messages in before:
                await client.chat("normal", messages)
    config = _config(a, b)
    usage_log = tmp_path / "usage.jsonl"
    config["usage_log"] = {"path": str(usage_log)}
    with ServedProxy(config, tmp_path / "second").start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await _ready(session, proxy)
            reported = [await client.chat("normal", m) for m in before]
            after = [_conversation(_system(f"late-{secrets.token_hex(4)}"), n) for n in range(4)]
            for messages in after + after:
                reported.append(await client.chat("normal", messages))
            metrics = await _metrics(session, proxy)
    lines = [orjson.loads(line) for line in usage_log.read_bytes().splitlines()]
    predicted = [u.get("predicted_cached_tokens") for u in lines if u.get("tenant") == "tenant-normal"]  # fmt: skip
    assert len(predicted) == len(reported)
    trust = re.findall(r"^tierproxy_kv_index_trust\{[^}]*\} (\S+)$", metrics, re.M)
    return predicted, reported, [float(t) for t in trust]


async def _kept(session: aiohttp.ClientSession, proxy: ServedProxy) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.get(proxy.admin_url + "/admin/status", headers=headers) as resp:
        placement = (await resp.json())["kv_placement"]
    return dict(placement["tenants"])


async def test_streams_the_engine_refused_inside_the_stream_leave_no_placement(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise 1: vLLM refuses some requests only once it streams (HTTP 200, then an error
    event of code 400 and [DONE]: ``top_logprobs`` past its ``max_logprobs``, a token id out
    of vocabulary). The engine did no work, yet the relay calls it a backend error, counted as
    run: the chooser keeps the prompts' blocks as placement (``kv_placement`` on
    /admin/status), homes them where they were sent, and notes their prefixes."""
    a, b = pair
    with ServedProxy(_config(a, b), tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            await _ready(session, proxy)
            before = await _kept(session, proxy)
            headers = {"Authorization": f"Bearer {KEYS['low']}"}
            events = []
            for n in range(4):
                body = {"model": "tiny", "max_tokens": 2, "stream": True, "logprobs": True,
                        "top_logprobs": 100, "messages": _conversation(_system(f"r{n}"), n)}  # fmt: skip
                async with session.post(proxy.url + CHAT, json=body, headers=headers) as r:
                    events.append((r.status, await r.read()))
            assert all(s == 200 and b'"code": 400' in raw for s, raw in events), events[0]
            after = await _kept(session, proxy)
            assert after == before, f"refused streams kept as placement: {before} -> {after}"
