"""kv_aware's placement, shaped only by real work, against `tierproxy serve` (a subprocess) in
front of two real CPU vLLMs (prefix caching, KV events, blocks of 32): one tenant's flood of
branch points, many times the chooser's room (``kv_aware.memory_blocks``, made small), does not
evict another tenant's system prompt's home (proxy.policies.kvgroups); a request whose client
left while it waited in vLLM's own queue leaves no placement, one that left while the engine
ran it does (proxy.policies.kvleft). Where a request went is read from the engines' own
counters and the proxy's /admin/status; nothing is timed. The in-process twins:
tests/unit/policies/test_kvgroups.py, test_kvleft.py."""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.bench.hostile.served import ADMIN_KEY, ServedProxy
from proxy.bench.inproc import KEYS
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
    inflight,
    kv_pair_config,
    proxy_metrics,
    served_count,
    system_prompt,
    until_trusted,
)

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
# Blocks of a ~300-token system prompt (9 full blocks of 32) stored once its prefill is done.
PREFILLED = 8
# Quiet: its engines must reach states (four streams running, a request queued) within counted
# polls, which an engine starting beside them on the same cores delayed past (make test-all).
pytestmark = [
    pytest.mark.integration,
    pytest.mark.engines(KV_EVENTS, KV_EVENTS_B),
    pytest.mark.quiet_engines,
]
MEMORY = 64  # the chooser's room: the victim keeps under half of it (its share)
# The flood's branch points: 120, past the room with a margin for prompts whose blocks could
# not be had in time (the tokenizer threads' turn: placed by load, not noted).
TRUNKS, POINTS = 6, 20


@pytest.fixture(scope="module")
def pair(engines: EngineFarm) -> tuple[EngineProcess, EngineProcess]:
    return engines.get(KV_EVENTS), engines.get(KV_EVENTS_B)


def _conversation(system: str, n: int) -> list[dict[str, str]]:
    """A new conversation under ``system`` (8 full blocks of the tiny model's tokens): its
    question fills two blocks more of its own."""
    question = f"q{n}: " + " ".join(f"w{n}x{i}" for i in range(10))
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def _drain(session: aiohttp.ClientSession, admin: str, url: str, drain: bool) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"url": url, "drain": drain}
    async with session.post(admin + "/admin/backends/drain", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()


async def _complete(session: aiohttp.ClientSession, base: str, ids: list[int]) -> None:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEYS['low']}"}
    async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()


def _ids(n: int) -> list[int]:
    """``n`` token ids of a prompt no other shares."""
    return [100 + secrets.randbelow(400) for _ in range(n)]


async def _flood(session: aiohttp.ClientSession, base: str) -> None:
    """Another tenant's work that ran, ``TRUNKS * POINTS`` branch points: each trunk of
    ``POINTS`` blocks, then after each of its first k blocks (deepest first) two prompts that
    go on two ways, a block each."""
    for _ in range(TRUNKS):
        trunk = _ids(POINTS * BLOCK + 1)
        await _complete(session, base, trunk)
        for k in range(POINTS, 0, -1):
            for _ in range(2):
                await _complete(session, base, trunk[: k * BLOCK] + _ids(BLOCK + 1))


async def _flood_predictions(usage_log: Path, n: int) -> list[int | None]:
    """The index's prediction for each of the flood's ``n`` requests (None: no blocks), once
    the usage log has them all (written as each ends)."""
    for _ in range(100):  # polls
        lines = [orjson.loads(line) for line in usage_log.read_bytes().splitlines()]
        flood = [u.get("predicted_cached_tokens") for u in lines if u.get("tenant") == "tenant-low"]  # fmt: skip
        if len(flood) >= n:
            return flood
        await asyncio.sleep(0.1)
    raise AssertionError(f"{len(flood)} of the flood's {n} usage records")


async def test_one_tenants_flood_of_branch_points_does_not_move_another_tenants_new_conversations(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """The victim (tenant-normal) has a system prompt whose home is one engine (its first
    conversations ran there); while that engine was drained one conversation ran on the other,
    so the prompt's blocks were last sent there. Its next new conversation goes home all the
    same (the branch point's home) after the flood; with one LRU for every tenant's branch
    points (main before this test) the flood evicted that home, and it followed the last turn
    instead."""
    config = kv_pair_config(*pair)
    config["policies"]["kv_aware"] = {"memory_blocks": MEMORY}
    usage_log = tmp_path / "usage.jsonl"
    config["usage_log"] = {"path": str(usage_log)}
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await until_trusted(session, proxy)

            async def counts() -> list[float]:
                return [await served_count(session, e) for e in pair]

            async def where(n: int) -> int:
                """The engine the victim's conversation ``n`` ran on."""
                before = await counts()
                await client.chat("normal", _conversation(system, n))
                deltas = [x - y for x, y in zip(await counts(), before, strict=True)]
                assert sorted(deltas) == [0, 1], deltas
                return deltas.index(1)

            system = f"victim-{secrets.token_hex(4)} " + " ".join(f"rule{i % 97}" for i in range(50))  # fmt: skip
            home = await where(0)
            assert [await where(n) for n in (1, 2)] == [home, home]  # a branch point at home
            await _drain(session, proxy.admin_url, pair[home].spec.url, True)
            away = await where(3)
            assert away != home
            await _drain(session, proxy.admin_url, pair[home].spec.url, False)
            # (No control here: a conversation run at home would make it the holder again.)
            await _flood(session, proxy.url)
            # The flood's prompts had their blocks (the index's prediction logged): noted.
            flood = await _flood_predictions(usage_log, TRUNKS * (2 * POINTS + 1))
            assert sum(p is not None for p in flood) > 2 * MEMORY + TRUNKS, flood
            assert await where(4) == home, (
                "the victim's new conversation followed its last turn: its system prompt's"
                " home was evicted by another tenant's branch points"
            )


async def _engine(session: aiohttp.ClientSession, engine: EngineProcess, name: str) -> float:
    """The engine's own metric ``name`` (vllm:num_requests_waiting, ...), all labels."""
    return (await _engine_scrape(session, engine, name))[0]


async def _engine_scrape(
    session: aiohttp.ClientSession, engine: EngineProcess, *names: str
) -> tuple[float, ...]:
    """The engine's metrics ``names``, each summed over its labels, from one scrape."""
    async with session.get(engine.spec.url + "/metrics") as resp:
        text = await resp.text()

    def total(name: str) -> float:
        pattern = rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$"
        return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))

    return tuple(total(name) for name in names)


async def _until_engine(
    session: aiohttp.ClientSession,
    engine: EngineProcess,
    name: str,
    want: Callable[[float], bool],
    polls: int = 300,
) -> None:
    for _ in range(polls):
        if want(await _engine(session, engine, name)):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the engine's {name} never as wanted")


async def _settled(client: Client, session: aiohttp.ClientSession, proxy: ServedProxy) -> None:
    """Until no request is in flight in the chooser's memory (one whose client left stays in
    flight until told): each look is a pick (another tenant's short prompt), which settles."""
    for n in range(400):  # polls (the chooser tells within pending_s, 10 s)
        placement = await _placement(session, proxy)
        if placement["in_flight"] == 0:
            return
        await client.chat("normal", [{"role": "user", "content": f"tick {n}"}])
        await asyncio.sleep(0.05)
    raise AssertionError("a request whose client left is still in flight")


async def _placement(session: aiohttp.ClientSession, proxy: ServedProxy) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.get(proxy.admin_url + "/admin/status", headers=headers) as resp:
        placement: dict[str, Any] = (await resp.json())["kv_placement"]
    return placement


def _left_in_time(task: asyncio.Task[int], seen: str) -> str | None:
    """None when the client can still leave: its answer has not come. An engine busy with
    long generations answers a scrape late (its API server shares the engine's core): a full
    run saw the queued request admitted, run and answered within one scrape, after which the
    client's "leaving" left nothing, and the engine counted it finished (stop 53)."""
    if task.done():
        return f"answered within the scrape that showed it ({task.result()}; {seen})"
    return None


async def _engine_queue(
    session: aiohttp.ClientSession, engine: EngineProcess
) -> tuple[float, float, float]:
    """The engine's requests running, waiting and finished, from one scrape."""
    running, waiting, done = await _engine_scrape(
        session, engine, RUNNING, WAITING, "vllm:request_success_total"
    )
    return running, waiting, done


_LOSSES = re.compile(r"^(tierproxy_kv_event_(?:gaps|errors|restarts)_total\{[^}]*\}) (\S+)$", re.M)
DROPPED = "KV-event connection dropped"  # the subscriber's log line: the index went cold


async def _index_losses(
    session: aiohttp.ClientSession, proxy: ServedProxy, engine: EngineProcess
) -> dict[str, float]:
    """The proxy's counts of ``engine``'s index dropped (a gap, an error, a restart), and of
    its connection dropped (its log's lines)."""
    text = await proxy_metrics(session, proxy)
    found = {m.group(1): float(m.group(2)) for m in _LOSSES.finditer(text) if f'"{engine.spec.url}"' in m.group(1)}  # fmt: skip
    found[DROPPED] = float(proxy.log_path.read_text(errors="replace").count(DROPPED))
    return found


async def _index_blocks(
    session: aiohttp.ClientSession, proxy: ServedProxy, engine: EngineProcess
) -> float:
    """The blocks the proxy's index of ``engine`` holds: its KV events, published by the engine
    core itself (a scrape of a busy engine's API server lagged by seconds in full runs)."""
    text = await proxy_metrics(session, proxy)
    pattern = rf'^tierproxy_kv_index_blocks\{{backend="{re.escape(engine.spec.url)}"\}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


async def _index_blind(
    session: aiohttp.ClientSession,
    proxy: ServedProxy,
    engine: EngineProcess,
    usage_log: Path,
    tenant: str,
    before: dict[str, float],
) -> str | None:
    """Why the proxy could not tell whether ``tenant``'s request ran (no prediction at its
    pick: the index cold, or the prompt's blocks not had in time; or the index dropped since
    ``before``); None: it could."""
    for _ in range(100):  # polls: the usage line is written as the request ends
        lines = [orjson.loads(line) for line in usage_log.read_bytes().splitlines()]
        if mine := [u for u in lines if u.get("tenant") == tenant]:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"no usage record of {tenant}'s request")
    if any(u.get("predicted_cached_tokens") is None for u in mine):
        return f"{tenant}: no prediction at its pick, the index cold or no blocks ({mine})"
    after = await _index_losses(session, proxy, engine)
    if lost := {k: v for k, v in after.items() if v != before.get(k, 0.0)}:
        return f"{tenant}: the index was dropped meanwhile ({lost})"
    return None


# Tenant-high's long generations, sent once each (none sent again), against the engine's four
# sequences; the plugin orders every one of them before a low-tier request. That request can
# take a slot only once fewer than four of them are left unfinished. So it has only waited where
# one scrape shows it in the engine (running + waiting + finished since the try began: all of
# them and one more) while at most HELD_FROM - 4 have finished, HELD_FROM having been in the
# engine before it was sent: at least four left at every moment since.
BUSY = 20
HELD_FROM = 16  # three waves of the engine's four may finish before a try is void
# The queued case's tries, each a low-tier tenant of its own (name -> key).
QUEUED = {f"tenant-queued-{n}": f"key-queued-{n}" for n in range(3)}


async def _answer(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]
) -> int:
    async with session.post(url, json=body, headers=headers) as r:
        await r.read()
        return r.status


async def test_a_request_whose_client_left_while_queued_in_vllm_leaves_no_placement(
    pair: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    """Promise B: one engine (the other drained) holds tenant-high's twenty long
    generations, past its ``--max-num-seqs`` (four); the proxy (room for them all) sends a
    low-tier tenant's request, which waits in vLLM's own queue behind them (one scrape counts
    it beside all twenty, at least four of them unfinished since it was sent: no slot was
    ever its), and the client leaves: vLLM aborts it, nothing computed. The proxy learns that
    only from the engine's KV events (none of its prompt stored): once the chooser tells, that
    tenant keeps no placement. A try that cannot show it so (too many finished first, the
    engine answered it: a starved machine) is void: the next is another tenant's. The control:
    tenant-low's request whose client leaves while the engine decodes it (its prefill counted
    by the engine, stored) is kept."""
    engine, other = pair
    # Each try of the queued case is another low-tier tenant's (a try the engine ran anyway
    # leaves its tenant a placement); tenant-low itself is the control's.
    tenants = [{"name": f"tenant-{t}", "tier": t, "keys": [{"sha256": hash_key(k)}]} for t, k in KEYS.items()]  # fmt: skip
    tenants += [{"name": name, "tier": "low", "keys": [{"sha256": hash_key(key)}]} for name, key in QUEUED.items()]  # fmt: skip
    # A connect timeout past a starved loop's: the streams must not lose the engine to it.
    config = kv_pair_config(*pair, tenants=tenants, backend_health={"connect_timeout_s": 30})
    for backend in config["backends"]:
        # Past the engine's four, with room left however far vLLM's queue (the streams' six,
        # the queued request) shrinks it (max_backend_waiting): vLLM queues the rest.
        backend["max_inflight"] = 2 * BUSY
    usage_log = tmp_path / "usage.jsonl"  # the index's prediction at each pick (None: cold)
    config["usage_log"] = {"path": str(usage_log)}
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await until_trusted(session, proxy)
            await _drain(session, proxy.admin_url, other.spec.url, True)

            async def leave(
                messages: list[dict[str, str]], *, queued: bool, key: str = KEYS["low"]
            ) -> str | None:
                """A low-tier tenant's long generation, left once the engine shows it queued
                (one scrape counting it beside all of tenant-high's generations) or prefilled
                (``PREFILLED`` more blocks in the proxy's index: the engine's KV events): None.
                Otherwise why the try is void (a generation ended first, the engine answered
                it, or it never showed)."""
                body = {"model": "tiny", "messages": messages, "max_tokens": 1600, "ignore_eos": True}  # fmt: skip
                headers = {"Authorization": f"Bearer {key}"}
                stored = await _index_blocks(session, proxy, engine)
                task = asyncio.create_task(_answer(session, proxy.url + CHAT, headers, body))
                seen = "no scrape"
                try:
                    # Bounded by the generations themselves: too many of them finish first.
                    for _ in range(3000):  # polls
                        if task.done():
                            return f"answered first ({task.result()}; last seen {seen})"
                        if queued:
                            running, waiting, done = await _engine_queue(session, engine)
                            seen = f"running {running:g}, waiting {waiting:g}, finished {done - finished_before:g}"  # fmt: skip
                            if done - finished_before > HELD_FROM - 4:
                                # It may have had a slot.
                                return f"too many finished first ({seen}; the proxy's in flight {await inflight(session, proxy)})"  # fmt: skip
                            if running + waiting + done - finished_before > BUSY:
                                return _left_in_time(task, seen)
                        elif await _index_blocks(session, proxy, engine) >= stored + PREFILLED:
                            return _left_in_time(task, seen)
                        await asyncio.sleep(0.05)
                    return f"never shown ({seen}; the proxy's in flight {await inflight(session, proxy)})"
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

            async def generate(n: int) -> None:
                system = system_prompt(f"busy-{n}-{secrets.token_hex(4)}")
                status, answer = await client.post("high", {"model": "tiny", "messages": conversation(system, n), "max_tokens": 1600, "ignore_eos": True})  # fmt: skip
                assert status == 200, answer

            left_queued = None
            voids: list[str] = []
            for name, key in QUEUED.items():
                # From an idle engine: an earlier test's work on it (a generation whose client
                # left, still decoding) was counted as this one's and voided every try.
                for gauge in (RUNNING, WAITING):  # bounded by that work's length, not a clock
                    await _until_engine(session, engine, gauge, lambda n: n == 0, polls=1200)
                finished_before = (await _engine_queue(session, engine))[2]
                index_before = await _index_losses(session, proxy, engine)
                busy = [asyncio.create_task(generate(n)) for n in range(BUSY)]
                try:
                    for _ in range(600):  # polls: HELD_FROM of them in the engine
                        running, waiting, _ = await _engine_queue(session, engine)
                        if running + waiting >= HELD_FROM:
                            void = None
                            break
                        await asyncio.sleep(0.05)
                    else:
                        void = f"never {HELD_FROM} in the engine (running {running:g}, waiting {waiting:g})"  # fmt: skip
                    queued = conversation(system_prompt(f"queued-{secrets.token_hex(4)}"), 0)
                    void = void or await leave(queued, queued=True, key=key)
                    if void is not None:
                        voids.append(void)
                    else:
                        left_queued = name
                        # Aborted while they run: the proxy let it go (its count), and the
                        # engine's queue holds no more than tenant-high's.
                        for _ in range(300):  # polls
                            if (await inflight(session, proxy))[0] <= BUSY:
                                break
                            await asyncio.sleep(0.02)
                        else:
                            raise AssertionError("the proxy kept the request whose client left")
                        # And vLLM let it go: the engine holds tenant-high's alone.
                        for _ in range(300):  # polls
                            running, waiting, done = await _engine_queue(session, engine)
                            if running + waiting + done - finished_before <= BUSY:
                                break
                            await asyncio.sleep(0.02)
                        else:
                            raise AssertionError(f"vLLM kept the request whose client left (running {running:g}, waiting {waiting:g}, finished {done - finished_before:g} of {BUSY})")  # fmt: skip
                finally:
                    for task in busy:
                        task.cancel()
                    await asyncio.gather(*busy, return_exceptions=True)
                await _until_engine(session, engine, RUNNING, lambda n: n == 0)
                if left_queued is not None:
                    # Told only by an index that saw it through: one cold at its pick, or
                    # dropped since, counts it as run (kvleft), as it should.
                    await _settled(client, session, proxy)
                    blind = await _index_blind(
                        session, proxy, engine, usage_log, name, index_before
                    )
                    if blind is None:
                        break
                    voids.append(blind)
                    left_queued = None
            if left_queued is None:
                raise AssertionError(f"none of {len(QUEUED)} tries could show it: {voids}")  # fmt: skip
            tenants_kept = (await _placement(session, proxy))["tenants"]
            assert left_queued not in tenants_kept, tenants_kept
            # The control: left while the engine decodes it (no stream: no byte came).
            await _until_engine(session, engine, RUNNING, lambda n: n == 0)
            ran = conversation(system_prompt(f"ran-{secrets.token_hex(4)}"), 0)
            void = await leave(ran, queued=False)
            assert void is None, f"the engine never prefilled the control: {void}"
            await _settled(client, session, proxy)
            tenants_kept = (await _placement(session, proxy))["tenants"]
            assert sum(tenants_kept["tenant-low"].values()) >= PREFILLED, tenants_kept
