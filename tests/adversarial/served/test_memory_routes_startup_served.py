"""Issue 22's second list, against the process that serves (`tierproxy serve` on uvloop with
aiohttp's C parser), each with realistic clients from the kit: a non-reader of a buffered
answer, uploads in progress and the memory budget, tokenizer calls beside a better tier's
chat, Responses usage in the usage log, /version under a flood, placeholder keys at start, and
a reload of read-at-start sections. The in-process twins: tests/adversarial/test_held_answers.py,
test_upload_budget.py, test_cheap_routes.py; tests/unit/api/test_usage_any_route.py,
test_routes.py (version), test_placeholder_keys.py, test_reload.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
import yaml
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import (
    RawClient,
    exchange,
    json_request,
    non_reader,
    request_bytes,
)
from proxy.bench.hostile.served import (
    ServedProxy,
    StartServed,
    ThreadedUpstream,
    served_config,
)
from proxy.bench.inproc import KEYS, SECRET
from proxy.config.tenants import hash_key
from proxy.relay.budget import held_estimate
from proxy.ticket import DEFAULT_SECRET_ENV

BIG_ANSWER_BYTES = 900 * 1024  # held whole; loopback alone would swallow it
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def big_answers(request: web.Request, n: int) -> web.StreamResponse | None:
    """A chat whose ``user`` is "big" gets a 0.9 MiB answer; anything else the fake's own."""
    if request.path != "/v1/chat/completions":
        return None
    body = await request.json()
    if body.get("user") != "big":
        return None
    message = {"role": "assistant", "content": "z" * BIG_ANSWER_BYTES}
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    answer = {"object": "chat.completion", "choices": [{"message": message}]}
    return web.json_response({**answer, "usage": usage}, dumps=_dumps)


def _dumps(value: object) -> str:
    return orjson.dumps(value).decode()


class Upstream(ThreadedUpstream):
    def __init__(self) -> None:
        # vLLM's routes; the tokenizer routes wait at a gate never opened (a busy tokenizer).
        self.routes = FakeVLLM(tokenize_gate=asyncio.Event(), script=big_answers)
        super().__init__(self.routes.app())


@pytest.fixture(scope="module")
def backend() -> Iterator[Upstream]:
    """This module's fake backend (the served fixtures forward to it)."""
    with Upstream() as upstream:
        yield upstream


def chat(tier: str, body: dict[str, object] | None = None) -> bytes:
    return json_request("/v1/chat/completions", body or CHAT, KEYS[tier])


async def wait_for(test: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not test():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# -- a. a non-reader of a buffered answer -------------------------------------------------------


async def test_non_readers_of_buffered_answers_are_cut_and_their_memory_freed(
    start_served: StartServed,
) -> None:
    # Four 0.9 MiB answers nearly fill a 4 MiB budget: held by non-readers, another tenant's
    # 100 KB request (0.6 MB reserved) would get 503 proxy_memory_full.
    proxy = start_served(
        relay={"send_idle_timeout_s": 1, "buffer_response_bytes": 2 * 1024 * 1024},
        limits={"max_held_bytes": 4 * 1024 * 1024},
    )
    mark = proxy.mark()
    stalled = [
        await non_reader(proxy.host, proxy.port, chat("normal", {**CHAT, "user": "big"}))
        for _ in range(4)
    ]
    try:
        await wait_for(
            lambda: proxy.count(r"status=499 outcome=client_stalled", mark) == 4,
            10,
            "four non-readers cut at the send-idle timeout",
        )
        body = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
        answer = await exchange(proxy.host, proxy.port, chat("high", body))
        assert answer.status == 200, answer.body[:300]
        for client in stalled:  # cut: the proxy closed them
            assert await client.closed_by_peer(5)
    finally:
        for client in stalled:
            client.close()
    assert proxy.tracebacks(mark) == 0


async def test_a_slow_but_steady_reader_of_a_buffered_answer_gets_it_whole(
    start_served: StartServed,
) -> None:
    proxy = start_served(relay={"send_idle_timeout_s": 1, "buffer_response_bytes": 2 << 20})
    client = await RawClient.connect(proxy.host, proxy.port)
    try:
        await client.send(chat("normal", {**CHAT, "user": "big"}))
        answer = await client.read_response(30)
        assert answer.status == 200 and len(answer.body) > BIG_ANSWER_BYTES
    finally:
        client.close()


# -- b. uploads in progress are budgeted ------------------------------------------------------


def upload_head(length: int) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
        f"Authorization: Bearer {KEYS['normal']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def test_an_upload_in_progress_holds_its_place_in_the_memory_budget(
    start_served: StartServed,
) -> None:
    upload = 1_000_000
    proxy = start_served(limits={"max_held_bytes": held_estimate(upload) + 100_000})
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 300_000}]}
    slow = await RawClient.connect(proxy.host, proxy.port)
    try:
        # Most of its body, and never the rest: reserved as the bytes came (not as announced).
        await slow.send(upload_head(upload) + b'{"model": "tiny", ' + b" " * (upload - 100_000))
        # Read and reserved by the proxy in milliseconds; a request beside it meanwhile would
        # make the upload's own growth the one refused (as is right, but not this test's case).
        await asyncio.sleep(0.5)
        refused = None
        deadline = time.monotonic() + 5
        while refused is None and time.monotonic() < deadline:
            answer = await exchange(proxy.host, proxy.port, chat("high", body))
            if answer.status == 503:
                refused = answer
            else:
                assert answer.status == 200
                await asyncio.sleep(0.05)
        assert refused is not None, "the upload in progress was not budgeted"
        assert refused.error_code() == "proxy_memory_full"
    finally:
        slow.close()
    deadline = time.monotonic() + 5
    while (answer := await exchange(proxy.host, proxy.port, chat("high", body))).status != 200:
        assert time.monotonic() < deadline, "the upload's reservation was never released"
        await asyncio.sleep(0.1)


# -- c. tokenizer calls never delay a better tier's generation ---------------------------------


async def test_low_tier_tokenize_calls_never_delay_a_high_tier_chat(
    backend: Upstream, tmp_path: Path
) -> None:
    config = served_config(backend.url, admin=False, tiers={"high": {"queue_timeout_s": 3}})
    config["backends"] = [{"url": backend.url, "max_inflight": 4}]  # 4 slots, 4 tokenizer calls
    proxy = ServedProxy(config, tmp_path, name="tokenize").start()
    try:
        await _tokenize_then_chat(proxy, backend)
    finally:
        proxy.stop()


async def _tokenize_then_chat(proxy: ServedProxy, backend: Upstream) -> None:
    busy = []
    try:
        # The backend's four slots, were they generation's (one tenant holds at most two).
        for tier in ("low", "low", "normal", "normal"):
            client = await RawClient.connect(proxy.host, proxy.port)
            busy.append(client)
            await client.send(
                json_request("/tokenize", {"model": "tiny", "prompt": "hi"}, KEYS[tier])
            )
        await wait_for(lambda: backend.routes.tokenizing >= 4, 5, "four tokenizer calls")
        answer = await exchange(proxy.host, proxy.port, chat("high"), timeout_s=10)
        assert answer.status == 200, answer.body[:300]
        # Served while the four tokenizer calls still held their slots (had it waited for them,
        # it would have waited for ever: counted, not timed).
        assert backend.routes.tokenizing >= 4
    finally:
        for client in busy:
            client.close()


async def test_one_tenant_takes_at_most_half_the_tokenizer_slots(
    backend: Upstream, tmp_path: Path
) -> None:
    # Finding #22: one tenant's four slow /tokenize calls made every other tenant's a 503.
    config = served_config(backend.url, admin=False)
    config["backends"] = [{"url": backend.url, "max_inflight": 4}]  # 4 tokenizer slots
    proxy = ServedProxy(config, tmp_path, name="tokenize-share").start()
    busy: list[RawClient] = []
    try:
        before = backend.routes.tokenizing
        low = json_request("/tokenize", {"model": "tiny", "prompt": "hi"}, KEYS["low"])
        for _ in range(2):  # its share: half of 4
            busy.append(client := await RawClient.connect(proxy.host, proxy.port))
            await client.send(low)
        await wait_for(lambda: backend.routes.tokenizing >= before + 2, 5, "its two calls")
        refused = await exchange(proxy.host, proxy.port, low, timeout_s=10)
        assert refused.status == 503, refused.body[:300]
        high = json_request("/tokenize", {"model": "tiny", "prompt": "hi"}, KEYS["high"])
        busy.append(client := await RawClient.connect(proxy.host, proxy.port))
        await client.send(high)  # admitted: it reaches the (busy) tokenizer, no 503
        await wait_for(lambda: backend.routes.tokenizing >= before + 3, 5, "the high call")
    finally:
        for client in busy:
            client.close()
        proxy.stop()


# -- d. Responses usage billed ------------------------------------------------------------------


async def test_responses_usage_is_in_the_usage_log(
    start_served: StartServed, backend: Upstream, tmp_path: Path
) -> None:
    log = tmp_path / "usage.jsonl"
    proxy = start_served(usage_log={"path": str(log)})
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 4}
    for stream in (False, True):
        request = json_request("/v1/responses", {**body, "stream": stream}, KEYS["high"])
        answer = await exchange(proxy.host, proxy.port, request)
        assert answer.status == 200

    def records() -> list[dict[str, object]]:
        text = log.read_text() if log.exists() else ""
        return [orjson.loads(line) for line in text.splitlines()]

    await wait_for(lambda: len(records()) == 2, 10, "two usage-log lines")
    expected = backend.routes.usage
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in records()] == [expected] * 2


# -- f. /version from a cache -------------------------------------------------------------------


async def test_a_version_flood_costs_the_backends_one_call(
    served: ServedProxy, backend: Upstream
) -> None:
    before = backend.routes.version_calls
    request = request_bytes("GET", "/version")
    answers = await asyncio.gather(
        *(exchange(served.host, served.port, request) for _ in range(100))
    )
    assert {a.status for a in answers} == {200}
    assert backend.routes.version_calls - before <= 1


# -- e. placeholder keys refused at start ------------------------------------------------------


def test_the_served_proxy_refuses_to_start_with_a_placeholder_key(
    backend: Upstream, tmp_path: Path
) -> None:
    config = served_config(backend.url, admin=False)
    config["tenants"].append(
        {"name": "chat-app", "tier": "high", "keys": [{"env": "CHAT_APP_KEY"}]}
    )
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, DEFAULT_SECRET_ENV: SECRET.decode(), "CHAT_APP_KEY": "change-me"}
    command = [sys.executable, "-m", "proxy.cli", "serve", "-c", str(path)]
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=300)  # a bound only: it exits at once
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode != 0
    assert "CHAT_APP_KEY" in out and "placeholder" in out


# -- g. a reload names every read-at-start section -----------------------------------------------


async def test_a_reload_names_every_read_at_start_section_it_cannot_apply(
    start_served: StartServed, tmp_path: Path
) -> None:
    proxy = start_served()
    mark = proxy.mark()
    config = dict(proxy.config)
    config["shared_state"] = {"url": "redis://127.0.0.1:1/0"}
    config["usage_log"] = {"path": str(tmp_path / "usage.jsonl")}
    config["tenants"] = [
        *config["tenants"],
        {"name": "added", "tier": "low", "keys": [{"sha256": hash_key("added-key")}]},
    ]
    new = proxy.config_path.with_suffix(".new")
    new.write_text(yaml.safe_dump(config))
    new.rename(proxy.config_path)
    await wait_for(lambda: proxy.count("config reloaded", mark) >= 1, 15, "the reload")
    for name in ("shared_state", "usage_log"):
        assert proxy.count(f"{name} changed; it takes effect only after a restart", mark) == 1
    answer = await exchange(
        proxy.host, proxy.port, json_request("/v1/chat/completions", CHAT, "added-key")
    )
    assert answer.status == 200  # the rest of the file is in force
