"""Red team of ``backends: kv_aware``'s placement promises against `tierproxy serve` (a
subprocess) in front of two real CPU vLLMs (prefix caching, KV events, blocks of 32): requests
that cannot run, and one tenant's traffic, must not move another tenant's conversations.

Where a request went is read from the engines themselves: each engine's own
``vllm:request_success_total`` and the answer's ``usage.prompt_tokens_details.cached_tokens``
(an engine that never saw a tenant's salt reports 0). Nothing is timed: counts only.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.bench.hostile.served import ServedProxy
from proxy.config.tenants import hash_key
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import KV_EVENTS
from tests.helpers.kvpair import (
    BLOCK,
    CHAT,
    KV_EVENTS_B,
    TIMEOUT,
    Client,
    conversation,
    kv_pair_config,
    served_count,
    system_prompt,
    until_trusted,
    write_diagnosis,
)

pytestmark = [pytest.mark.integration, pytest.mark.engines(KV_EVENTS, KV_EVENTS_B)]


@pytest.fixture(scope="module")
def pair(engines: EngineFarm) -> tuple[EngineProcess, EngineProcess]:
    return engines.get(KV_EVENTS), engines.get(KV_EVENTS_B)


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
    with ServedProxy(kv_pair_config(a, b), tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await until_trusted(session, proxy)
            system = system_prompt(f"victim-{secrets.token_hex(4)}")
            counts = [await served_count(session, e) for e in pair]
            for n in range(3):
                await client.chat("normal", conversation(system, n))
            after = [await served_count(session, e) for e in pair]
            deltas = [x - y for x, y in zip(after, counts, strict=True)]
            assert sorted(deltas) == [0, 3], f"the victim's conversations scattered: {deltas}"
            home = pair[deltas.index(3)]
            # The attacker's own prompt, placed on the victim's home (tries: its first
            # placement goes by room and balance; an attacker can try until one lands there).
            mine: list[dict[str, str]] | None = None
            for _ in range(6):
                prompt = conversation(system_prompt(f"attacker-{secrets.token_hex(4)}"), 0)
                before = await served_count(session, home)
                await client.chat("low", prompt)
                if await served_count(session, home) > before:
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
            async with client.running("normal", conversation(system, 1)):
                return await client.chat("normal", conversation(system, 9))


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


@pytest.mark.xfail(  # not strict: how much the flood slows /tokenize depends on the machine
    strict=False,
    reason="known limit, docs/kv-cache.md: without kv_cache.tokenizer a prompt's tokens come"
    " from the engines' /tokenize, which one tenant's flood of long prompts slows for all (the"
    " victim's calls time out: its turns get no blocks; those that cannot be counted past the"
    " context reach the engines and hold their slots). With the tokenizer configured (the test"
    " below) the promise holds.",
)
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
    config = kv_pair_config(a, b)
    if not local:
        config["kv_cache"]["tokenizer"] = None  # vLLM's /tokenize: the default
    usage_log = tmp_path / "usage.jsonl"
    config["usage_log"] = {"path": str(usage_log)}
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await until_trusted(session, proxy)
            quiet = await _turns(client, system_prompt(f"calm-{secrets.token_hex(4)}"), 6)
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
                attacked = await _turns(client, system_prompt(f"victim-{secrets.token_hex(4)}"), 6)
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


# Failed in 3 of 5 full runs on 2026-12-05 07:29-08:27 UTC (alice's turn after bob's went to
# bob's engine; alone, 5 of 5 passed); cause not found. It then passed (as a non-strict xfail)
# in every full run and `make test` since 09:00 UTC that day (stops 52-55, several beside a
# simulator's load): a test that cannot fail tells nothing, so it is a plain test again. A failure writes what the chooser saw
# (write_diagnosis, under the run's engine logs).
async def test_a_tenants_first_conversation_under_its_groups_preamble_starts_apart(
    pair: tuple[EngineProcess, EngineProcess], engines: EngineFarm, tmp_path: Path
) -> None:
    """Two tenants of one cache group share a long preamble. Alice lives on one engine; bob's
    first conversation, mostly that preamble, starts on the engine no tenant lives on (joined,
    their histories would share one cache while the other idled: issue 32, ``s32023``), and
    his send of the preamble there does not move alice's conversations. Read from the engines:
    which one finished each request, and the prompt tokens it found cached."""
    keys = {"alice": "key-alice", "bob": "key-bob"}
    tenants = [
        {"name": n, "tier": "normal", "cache_group": "team", "keys": [{"sha256": hash_key(k)}]}
        for n, k in keys.items()
    ]
    a, b = pair
    preamble = system_prompt(f"team-{secrets.token_hex(4)}") * 2  # ~600 tokens
    config = kv_pair_config(a, b, tenants=tenants)
    usage_log = tmp_path / "usage.jsonl"  # the index's prediction at each pick
    config["usage_log"] = {"path": str(usage_log)}
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            # Its engines are idle when it starts (tests/helpers/enginefarm.until_idle): work an
            # earlier test left on one (vLLM's queue past the allowance shrinks its room) would
            # make the balance rule move alice off it.
            await until_trusted(session, proxy)

            async def turn(who: str, own: str, n: int, more: int = 0) -> tuple[int, int]:
                """(the engine that served it, the prompt tokens it found cached); ``more``: the
                conversation ``n`` goes on that many turns"""
                messages = conversation(f"{preamble} {own}", n)
                for k in range(more):
                    messages += [
                        {"role": "assistant", "content": f"a{n}.{k}"},
                        {"role": "user", "content": f"q{n}.{k}?"},
                    ]
                body = {"model": "tiny", "messages": messages, "max_tokens": 1}
                headers = {"Authorization": f"Bearer {keys[who]}"}
                before = [await served_count(session, e) for e in pair]
                async with session.post(proxy.url + CHAT, json=body, headers=headers) as r:
                    answer = await r.json(content_type=None)
                    assert r.status == 200, answer
                after = [await served_count(session, e) for e in pair]
                served = [i for i in (0, 1) if after[i] > before[i]]
                assert len(served) == 1, (before, after)
                return served[0], int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

            alice = [await turn("alice", "You are alice's helper.", n) for n in range(3)]
            assert len({engine for engine, _ in alice}) == 1, alice
            home = alice[0][0]
            assert alice[2][1] >= 16 * BLOCK  # her second and third found the preamble cached
            engine, cached = await turn("bob", "You are bob's helper.", 0)
            assert engine != home, "bob's first conversation joined alice's engine"
            assert cached < 16 * BLOCK  # the other engine never saw the preamble
            # Alice's conversation under way stays home, finding its history cached. (Not a new
            # one: three of hers lately crowd her home, and the spread rule may start her next
            # conversation elsewhere by its own share, whatever bob sent: a full run here saw it.)
            engine, cached = await turn("alice", "You are alice's helper.", 2, more=1)
            where: Path | str = engines.log_dir / "kv-placement-preamble"
            if engine != home or cached < 16 * BLOCK:  # what the chooser saw, for the next look
                try:
                    await write_diagnosis(session, proxy, pair, usage_log, Path(where))
                except Exception as exc:  # the assertion below still says what failed
                    where = f"no diagnosis ({exc!r})"
            assert engine == home and cached >= 16 * BLOCK, (engine, cached, f"{where}.*")
