"""A request larger than a backend's whole ``max_tokens_inflight``, against ``tierproxy serve``
(a subprocess) in front of a real CPU vLLM, while another tenant of its tier keeps that backend
busy with a steady flood: it ran only on an idle backend, the flood never let it be idle, and
it waited out its queue timeout for a 503 (red team, stop 50). Now the backend drains for it:
the flood waits in the proxy's queue until it has been sent, and it is served. Nothing is
timed: the flood runs, without a pause, until the large request has its answer.

Also clients that stop reading, on the same engine: a stalled stream hands its tokens on at
vLLM's end (the relay's read-ahead), and the bills of those that stall or leave meanwhile."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.bench.hostile.kit import RawClient, json_request
from proxy.bench.hostile.served import ADMIN_KEY, HOST, ServedProxy, admin_sections
from proxy.bench.inproc import KEYS, make_config
from proxy.config.tenants import hash_key
from proxy.tools.engine import EngineProcess
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import PROMPT_DETAILS

pytestmark = [pytest.mark.integration, pytest.mark.engines(PROMPT_DETAILS)]
CHAT = "/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=180)
BUDGET = 4_000  # the backend's max_tokens_inflight
LOOPS = 6  # the flood's clients, each sending its next request as soon as one ends
# The large request: 4,500 tokens of output, past the whole budget (3 x 800 was done before the
# best tier's 8-token answer came back on a fast engine, in a full run here).
SEQUENCES, EACH = 3, 1_500
# Under the flood nothing races the large request's end: 3 x 800 tokens past a 2,000 budget is
# enough (a 503 without the drain; 4,500 tokens took 37 s of make test's 8 minutes, this 8 s).
FLOOD_BUDGET, FLOOD_SEQUENCES, FLOOD_EACH = 2_000, 3, 800
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(PROMPT_DETAILS)


async def _post(
    session: aiohttp.ClientSession, proxy: ServedProxy, key: str, body: dict[str, object]
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(proxy.url + CHAT, json=body, headers=headers) as r:
        return r.status, await r.json()


async def _backend_view(session: aiohttp.ClientSession, proxy: ServedProxy) -> dict[str, Any]:
    """The backend's entry in /admin/backends (tokens_inflight, held_for, ...)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.get(proxy.admin_url + "/admin/backends", headers=headers) as r:
        view: dict[str, Any] = (await r.json())["backends"][0]
        return view


async def _until_running(session: aiohttp.ClientSession, proxy: ServedProxy) -> None:
    """Until the backend counts tokens in flight (a stream sent, now running)."""
    async with asyncio.timeout(60):
        while (await _backend_view(session, proxy))["tokens_inflight"] == 0:
            await asyncio.sleep(0.05)


async def _usage(usage_log: Path, tenants: set[str], polls: int = 200) -> dict[str, dict[str, Any]]:
    """Each of ``tenants``' usage record (one request each), once all are written (as each
    request ends), counted in ``polls`` of 50 ms."""
    for _ in range(polls):
        if usage_log.exists():
            lines = [orjson.loads(line) for line in usage_log.read_bytes().splitlines()]
            found = {u["tenant"]: u for u in lines if u.get("tenant") in tenants}
            if found.keys() == tenants:
                return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"usage records of {tenants} never all written")


def _billed_config(
    backend: dict[str, Any], tmp_path: Path, keys: dict[str, str], **sections: Any
) -> tuple[dict[str, Any], Path]:
    """A served config in front of ``backend``: a tenant of the normal tier for each name ->
    key, the admin API, and a usage log (its path returned too)."""
    tenants = [
        {"name": name, "tier": "normal", "keys": [{"sha256": hash_key(key)}]}
        for name, key in keys.items()
    ]
    config = make_config([backend], tenants=tenants, **sections, **admin_sections())
    usage_log = tmp_path / "usage.jsonl"
    config["usage_log"] = {"path": str(usage_log)}
    return config, usage_log


@pytest.mark.long  # a steady flood of six clients until the large request is served
async def test_a_request_past_the_whole_token_budget_is_served_under_a_steady_flood(
    engine: EngineProcess, tmp_path: Path
) -> None:
    tenants: list[dict[str, Any]] = [
        {"name": "flood", "tier": "normal", "keys": [{"sha256": hash_key(KEYS["normal"])}]},
        {"name": "batch", "tier": "normal", "keys": [{"sha256": hash_key(KEYS["low"])}]},
    ]
    backend = {"url": engine.spec.url, "max_inflight": 8, "max_tokens_inflight": FLOOD_BUDGET}
    # Under the old rule the large request would wait out the tier's queue timeout for a 503.
    tiers = {"normal": {"queue_timeout_s": 90, "request_timeout_s": 150}}
    config = make_config([backend], tiers=tiers, tenants=tenants, **admin_sections())
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            done = asyncio.Event()
            flood_answers: list[int] = []

            async def flood() -> None:
                body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 60, "ignore_eos": True}
                while not done.is_set():
                    status, _ = await _post(session, proxy, KEYS["normal"], body)
                    flood_answers.append(status)

            loops = [asyncio.create_task(flood()) for _ in range(LOOPS)]
            try:
                async with asyncio.timeout(120):  # the flood under way
                    while len(flood_answers) < 2 * LOOPS:
                        assert not all(loop.done() for loop in loops), loops[0].exception()
                        await asyncio.sleep(0.05)
                big = {
                    "model": "tiny",
                    "messages": MESSAGES,
                    "max_tokens": FLOOD_EACH,
                    "n": FLOOD_SEQUENCES,
                    "ignore_eos": True,
                }
                status, body = await _post(session, proxy, KEYS["low"], big)
            finally:
                done.set()
                await asyncio.gather(*loops, return_exceptions=True)
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == FLOOD_SEQUENCES * FLOOD_EACH, body["usage"]
            # The flood waited in the proxy's queue while the backend drained, then went on:
            # every request of it served.
            assert set(flood_answers) == {200}, sorted(set(flood_answers))


async def test_the_best_tier_is_served_beside_a_worse_tiers_request_past_the_budget(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """A worse tier's request past the whole budget runs alone once the backend is idle; the
    best tier waited until it ended (its 503 at the queue timeout: red team F2, stop 51). The
    best tier counts only its own tokens against the budget: the proxy sends it upstream while
    the large one runs (read from the proxy's usage log: when each was sent, when each ended;
    on a fast engine vLLM's own API server, busy with the large one's tokens, may answer the
    small one only after it). The large request's client then leaves, so a slow engine is not
    waited for."""
    tenants: list[dict[str, Any]] = [
        {"name": "batch", "tier": "normal", "keys": [{"sha256": hash_key(KEYS["normal"])}]},
        {"name": "chat", "tier": "high", "keys": [{"sha256": hash_key(KEYS["high"])}]},
    ]
    backend = {"url": engine.spec.url, "max_inflight": 8, "max_tokens_inflight": BUDGET}
    config = make_config([backend], tenants=tenants, **admin_sections())
    usage_log = tmp_path / "usage.jsonl"  # where the best tier's request waited, if it did
    config["usage_log"] = {"path": str(usage_log)}
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            big = {"model": "tiny", "messages": MESSAGES, "max_tokens": EACH, "n": SEQUENCES}
            big["ignore_eos"] = True
            large = asyncio.create_task(_post(session, proxy, KEYS["normal"], big))
            try:
                async with asyncio.timeout(120):  # it runs, past the whole budget
                    while (await _backend_view(session, proxy))["tokens_inflight"] <= BUDGET:
                        assert not large.done(), large.result()
                        await asyncio.sleep(0.05)
                small = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}
                status, body = await _post(session, proxy, KEYS["high"], small)
                assert status == 200, body
            finally:
                large.cancel()
                await asyncio.gather(large, return_exceptions=True)
            used = await _usage(usage_log, {"batch", "chat"})
    # Sent upstream (a record's end less its engine seconds, on the proxy's one clock) in the
    # first half of the large one's time upstream: without the fix it waited in the proxy's
    # queue until the large one's lease was released, at its end (a ratio of one run's own
    # times, not a bound in seconds).
    large_sent = used["batch"]["ts"] - used["batch"]["engine_s"]
    sent = used["chat"]["ts"] - used["chat"]["engine_s"]
    assert sent - large_sent < 0.5 * used["batch"]["engine_s"], used


@pytest.mark.long  # ~3,600 tokens with 20 logprobs each decoded while it waits
async def test_a_stream_its_client_stopped_reading_does_not_hold_its_tier_back(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """A stream whose client stopped reading with more of its answer left than the relay's
    read-ahead holds (megabytes of logprobs, past ``relay.read_ahead_bytes``) is done in vLLM
    but keeps its tokens until the relay cuts it (``relay.send_idle_timeout_s``, here 120 s).
    With another tenant's request holding the backend for tokens those keep out, every request
    of the tier waited on an idle engine (red team S1, stop 51). Once scrapes show vLLM running
    nothing the proxy counts, a request that fits goes: it is served while the stalled stream
    still holds its tokens (one whose rest fits the read-ahead frees them at vLLM's end: the
    next test)."""
    tenants: list[dict[str, Any]] = [
        {"name": name, "tier": "normal", "keys": [{"sha256": hash_key(key)}]}
        for name, key in (("stalled", KEYS["normal"]), ("large", KEYS["low"]), ("small", "k-s"))
    ]
    # The stalled stream's 3,615 tokens and a small request fit; the large one's 1,515 do not.
    backend = {"url": engine.spec.url, "max_inflight": 8, "max_tokens_inflight": 4_000}
    tiers = {"normal": {"queue_timeout_s": 150}}
    relay = {"send_idle_timeout_s": 120}
    config = make_config([backend], tiers=tiers, tenants=tenants, relay=relay, **admin_sections())
    with ServedProxy(config, tmp_path).start() as proxy:
        # ~2 x 1,800 tokens with 20 logprobs each: megabytes, far past what the socket buffers
        # of a client with a 4 KiB window swallow.
        stream = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1_800, "n": 2}
        stream.update(stream=True, ignore_eos=True, logprobs=True, top_logprobs=20)
        stalled = await RawClient.connect(HOST, proxy.port)
        try:
            await stalled.send(json_request(CHAT, stream, KEYS["normal"]))
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                await _until_running(session, proxy)
                large = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1_500}
                held = asyncio.create_task(
                    _post(session, proxy, KEYS["low"], large)
                )  # does not fit: holds
                try:
                    async with asyncio.timeout(60):
                        while (await _backend_view(session, proxy))["held_for"] is None:
                            await asyncio.sleep(0.05)
                    status, body = await _post(
                        session,
                        proxy,
                        "k-s",
                        {"model": "tiny", "messages": MESSAGES, "max_tokens": 8},
                    )
                    assert status == 200, body
                    # Served while the stalled stream still held its tokens in the proxy.
                    assert (await _backend_view(session, proxy))["tokens_inflight"] >= 2 * 1_800
                finally:
                    held.cancel()
                    await asyncio.gather(held, return_exceptions=True)
        finally:
            stalled.sock.close()


# A stalled stream of 1,000 tokens with 20 logprobs each (~1 KB an event: a megabyte), past what
# a non-reader's connection swallows (a ~200 KB stream without logprobs was swallowed whole by
# the kernel over the seconds vLLM took), within this test's read-ahead. Its 1,015 tokens and
# the next request's 515 pass a 1,400 budget.
STALLED_TOKENS, KEPT_TOKENS, READ_AHEAD_BUDGET = 1_000, 500, 1_400
READ_AHEAD = 8 * 1024 * 1024


async def test_a_stalled_stream_within_the_read_ahead_hands_its_tokens_on_at_vllms_end(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """A stream whose client stopped reading, the rest of its answer within the relay's
    read-ahead (set to 8 MiB here: the kernel swallows a few hundred KB of a slow stream
    whatever the client's window): the proxy reads it to vLLM's end and hands the backend's tokens on then, so a
    request they kept out is served while the stalled client has still read nothing (before,
    it waited for the send-idle cut, here 120 s, past its own queue timeout: a 503). The stalled
    client then reads its whole answer. Nothing is timed: the usage log's order tells."""
    backend = {"url": engine.spec.url, "max_inflight": 8, "max_tokens_inflight": READ_AHEAD_BUDGET}
    tiers = {"normal": {"queue_timeout_s": 100}}  # under the send-idle bound
    relay = {"send_idle_timeout_s": 120, "read_ahead_bytes": READ_AHEAD}
    keys = {"stalled": KEYS["normal"], "kept": KEYS["low"]}
    config, usage_log = _billed_config(backend, tmp_path, keys, tiers=tiers, relay=relay)
    with ServedProxy(config, tmp_path).start() as proxy:
        stream = {"model": "tiny", "messages": MESSAGES, "max_tokens": STALLED_TOKENS}
        stream.update(stream=True, ignore_eos=True, logprobs=True, top_logprobs=20)
        stalled = await RawClient.connect(HOST, proxy.port)
        try:
            await stalled.send(json_request(CHAT, stream, KEYS["normal"]))
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                await _until_running(session, proxy)
                kept = {"model": "tiny", "messages": MESSAGES, "max_tokens": KEPT_TOKENS}
                status, body = await _post(session, proxy, KEYS["low"], kept)
                assert status == 200, body
                assert (await _backend_view(session, proxy))["tokens_inflight"] == 0
            answer = await stalled.read_response(60)
        finally:
            stalled.sock.close()
        assert answer.status == 200 and answer.body.endswith(b"data: [DONE]\n\n")
        assert len(answer.body) < READ_AHEAD, len(answer.body)
        used = await _usage(usage_log, {"stalled", "kept"})
    # The kept request ended before the stalled stream did (its client read it only then).
    assert used["kept"]["ts"] < used["stalled"]["ts"], (len(answer.body), used)
    assert used["stalled"]["outcome"] == "ok", used
    assert used["stalled"]["completion_tokens"] == STALLED_TOKENS, used


async def test_a_client_that_leaves_while_the_read_ahead_drains_is_billed_vllms_usage(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """Red team, 2026-12-06: a client that left (a reset) while the read-ahead held the rest of
    its answer, vLLM's usage in it, had its handler cancelled by aiohttp; the relay's result
    went with it, and the bill fell to the bytes bound (2,306 completion and 205 prompt tokens
    against vLLM's 1,500 and 25). The usage was read before the client left: it is the bill."""
    relay = {"send_idle_timeout_s": 120, "read_ahead_bytes": READ_AHEAD}
    backend, keys = {"url": engine.spec.url}, {"leaver": KEYS["normal"]}
    config, usage_log = _billed_config(backend, tmp_path, keys, relay=relay)
    with ServedProxy(config, tmp_path).start() as proxy:
        stream = {"model": "tiny", "messages": MESSAGES, "max_tokens": STALLED_TOKENS}
        stream.update(stream=True, ignore_eos=True, logprobs=True, top_logprobs=20)
        leaver = await RawClient.connect(HOST, proxy.port)
        try:
            await leaver.send(json_request(CHAT, stream, KEYS["normal"]))
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                await _until_running(session, proxy)
                async with asyncio.timeout(120):  # vLLM's end read: the backend handed on
                    while (await _backend_view(session, proxy))["tokens_inflight"] > 0:
                        await asyncio.sleep(0.05)
        finally:
            leaver.abort()  # nothing read: a reset
        used = (await _usage(usage_log, {"leaver"}))["leaver"]
    assert used["outcome"] == "client_gone", used
    assert used["usage_basis"] == "backend", used
    assert used["completion_tokens"] == STALLED_TOKENS, used


async def test_a_large_answer_cut_before_its_usage_is_billed_its_reservation(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """Red team, 2026-12-06: a non-stream answer past ``buffer_response_bytes`` is streamed
    through, and vLLM writes its usage after the choices. A client that stopped reading before
    the usage went by was cut at the send-idle bound and billed nothing (five 4 x 1,000-token
    answers of ~5 MB: 20,000 tokens generated, past the tier's 16,000 a day, and the next
    request still served). Cut before its usage, it is billed its reservation."""
    relay = {"send_idle_timeout_s": 2, "read_ahead_bytes": 0}
    backend, keys = {"url": engine.spec.url}, {"staller": KEYS["normal"]}
    config, usage_log = _billed_config(backend, tmp_path, keys, relay=relay)
    sequences = 4
    with ServedProxy(config, tmp_path).start() as proxy:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": STALLED_TOKENS}
        body.update(n=sequences, ignore_eos=True, logprobs=True, top_logprobs=20)
        staller = await RawClient.connect(HOST, proxy.port)  # a 4 KiB window, never read
        try:
            await staller.send(json_request(CHAT, body, KEYS["normal"]))
            # vLLM generates it all first (seconds on a busy CPU), then the 2 s cut.
            used = (await _usage(usage_log, {"staller"}, polls=3_000))["staller"]
        finally:
            staller.sock.close()
    assert used["outcome"] == "client_stalled", used
    assert used["usage_basis"] == "reservation", used
    assert used["completion_tokens"] >= sequences * STALLED_TOKENS, used


async def test_a_request_the_tiers_limit_cuts_is_billed_its_reservation(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """Red team, 2026-12-06: a non-stream request cut by its tier's ``request_timeout_s`` (a
    504) was billed nothing, though vLLM ran it (six of them: 3,641 tokens generated against a
    3,000-token day, the counter at 0); so was a /v1/responses stream of tokens without text
    (a special token vLLM skips: the stream sends no event for it), prompt and all. Both are
    billed their reservation now."""
    tiers = {"normal": {"request_timeout_s": 1.5}}
    backend, keys = {"url": engine.spec.url}, {"cut": KEYS["normal"], "silent": KEYS["low"]}
    config, usage_log = _billed_config(backend, tmp_path, keys, tiers=tiers)
    silent = {"logit_bias": {"3": 100}}  # <pad>: a special token, no text
    with ServedProxy(config, tmp_path).start() as proxy:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1_500, "ignore_eos": True}
            status, _ = await _post(session, proxy, KEYS["normal"], chat)
            assert status == 504
            used = (await _usage(usage_log, {"cut"}, polls=600))["cut"]
            assert (used["outcome"], used["usage_basis"]) == ("timeout", "reservation"), used
            assert used["completion_tokens"] == 1_500 and used["prompt_tokens"] > 0, used
            responses = {"model": "tiny", "input": "hello there", "max_output_tokens": 1_500}
            responses.update(stream=True, ignore_eos=True, **silent)
            headers = {"Authorization": f"Bearer {KEYS['low']}"}
            async with session.post(
                proxy.url + "/v1/responses", json=responses, headers=headers
            ) as r:
                body = await r.read()
            assert r.status == 200 and b".delta" not in body and b"request_timeout" in body
            used = (await _usage(usage_log, {"silent"}, polls=600))["silent"]
            assert (used["outcome"], used["usage_basis"]) == ("timeout", "reservation"), used
            assert used["completion_tokens"] >= 1_500 and used["prompt_tokens"] > 0, used


async def test_a_responses_stream_vllm_refuses_after_its_opening_events_is_billed_nothing(
    engine: EngineProcess, tmp_path: Path
) -> None:
    """Fresh eyes, 2026-12-06: vLLM sends a Responses stream's opening events before its
    engine checks the request; an out-of-vocab ``logit_bias`` then breaks the stream, with no
    error event and no final one. Billed as a cut stream (its reservation: 136 + 900 tokens
    for no engine work) and counted as the backend's failure, which any tenant could repeat;
    it is vLLM's refusal: nothing billed, the backend not blamed."""
    backend, keys = {"url": engine.spec.url}, {"odd": KEYS["normal"]}
    config, usage_log = _billed_config(backend, tmp_path, keys)
    with ServedProxy(config, tmp_path).start() as proxy:
        body = {"model": "tiny", "input": "hello there", "max_output_tokens": 900}
        body.update(stream=True, logit_bias={"10000000": 100})  # past any vocabulary
        headers = {"Authorization": f"Bearer {KEYS['normal']}"}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(proxy.url + "/v1/responses", json=body, headers=headers) as r:
                answer = await r.read()
            assert b"response.completed" not in answer, answer[:500]
            used = (await _usage(usage_log, {"odd"}))["odd"]
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            async with session.get(proxy.admin_url + "/metrics", headers=admin) as r:
                metrics = await r.text()
    assert used["usage_basis"] == "none", used
    assert (used["prompt_tokens"], used["completion_tokens"]) == (0, 0), used
    blamed = [m for m in metrics.splitlines() if m.startswith("tierproxy_backend_errors_total{")]
    assert all(float(m.rsplit(" ", 1)[1]) == 0 for m in blamed), blamed
