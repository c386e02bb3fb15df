"""vLLM-like answers through the relay, against `tierproxy serve` (uvloop, C parser) in front
of a backend that answers as vLLM can: an answer too large for the relay's bounds never gets
the backend ejected (fresh eyes #2), ``n`` > 1 streams pass every choice's tokens as they come
(#3), and the backend is asked for identity answers (#12)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import (
    ADMIN_KEY,
    NullBackend,
    ServedProxy,
    StartServed,
    auth_header,
)

ONE_CHAT = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
STEPS, STEP_S = 30, 0.1  # choice 1 goes on this long after choice 0 finished


def event(data: object) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def choice(index: int, text: str | None, finish: str | None = None) -> bytes:
    delta = {"content": text} if text is not None else {}
    return event(
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
        }
    )


class VllmLike:
    """What vLLM sends: echo + logprobs on a long prompt put ~2 MB in a completion stream's
    first event; n=2 interleaves choices, choice 0 finishing first. Records Accept-Encoding."""

    def __init__(self) -> None:
        self.accept_encodings: list[str | None] = []
        self.steps = 0  # choice 1's chunks the running stream has sent after choice 0 finished

    async def answer(self, request: web.Request, n: int) -> web.StreamResponse | None:
        """FakeVLLM's script: these two routes are this module's; the rest the fake's own."""
        if request.path == "/v1/completions":
            return await self.completions(request)
        if request.path == "/v1/chat/completions":
            return await self.chat(request)
        return None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = {"choices": [{"index": 0, "text": "x", "logprobs": {"top": "y" * 2_000_000}}]}
        try:
            await resp.write(event(first) + b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the proxy closed on it at the bound
        return resp

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.accept_encodings.append(request.headers.get("Accept-Encoding"))
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            answer = {
                "id": "c",
                "object": "chat.completion",
                "model": "null",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(choice(0, "a") + choice(1, "b") + choice(0, None, "stop"))
        self.steps = 0
        for _ in range(STEPS):
            await asyncio.sleep(STEP_S)
            self.steps += 1  # before the write: a chunk read is never ahead of the count
            await resp.write(choice(1, "b"))
        usage = {"prompt_tokens": 1, "completion_tokens": STEPS + 2, "total_tokens": STEPS + 3}
        await resp.write(choice(1, None, "length"))
        await resp.write(event({"choices": [], "usage": usage, "system_fingerprint": "fp"}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def vllm_like() -> VllmLike:
    return VllmLike()


@pytest.fixture(scope="module")
def backend(vllm_like: VllmLike) -> Iterator[NullBackend]:
    with NullBackend(FakeVLLM(model="null", script=vllm_like.answer)) as upstream:
        yield upstream


async def backend_states(proxy: ServedProxy) -> list[str]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{proxy.admin_url}/admin/status", headers=headers, timeout=aiohttp.ClientTimeout(5)
        ) as resp,
    ):
        return [b["state"] for b in (await resp.json())["backends"]]


async def test_answers_too_large_never_eject_the_backend(start_served: StartServed) -> None:
    proxy = start_served()
    attack = json_request(
        "/v1/completions",
        {"model": "null", "prompt": "long", "stream": True, "echo": True, "logprobs": 20},
        None,
        {"Authorization": auth_header("low")},
    )
    for _ in range(6):  # two in a row ejected the backend (1 s, doubling)
        resp = await exchange(proxy.host, proxy.port, attack)
        assert resp.status == 502 and resp.error_code() == "upstream_too_large", resp.body[:200]
    assert await backend_states(proxy) == ["healthy"]
    good = json_request(
        "/v1/chat/completions", ONE_CHAT, None, {"Authorization": auth_header("high")}
    )
    # Healthy (above), so no ejection to wait out: served, and still healthy after.
    assert (await exchange(proxy.host, proxy.port, good)).status == 200
    assert await backend_states(proxy) == ["healthy"]


async def test_n_choices_stream_as_they_come(
    start_served: StartServed, vllm_like: VllmLike
) -> None:
    proxy = start_served()
    body = {**ONE_CHAT, "stream": True, "n": 2, "max_tokens": 20}
    arrivals: list[tuple[int, bytes]] = []  # the backend's steps sent when each line came
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{proxy.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": auth_header("normal")},
            timeout=aiohttp.ClientTimeout(30),
        ) as resp,
    ):
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                arrivals.append((vllm_like.steps, line.strip()))
    choice_1 = [at for at, data in arrivals if b'"index":1' in data and b'"b"' in data]
    assert len(choice_1) == STEPS + 1
    # Choice 1's tokens arrive while it runs (they waited for the stream's end behind choice
    # 0's terminal chunk: the client saw nothing for the whole stream). Counted in the
    # backend's steps, not in seconds before the end a busy host's stall of the proxy eats:
    # most of them came before the backend sent its last (all but a stall's worth).
    early = sum(1 for steps in choice_1[1:] if steps < STEPS)
    assert early >= STEPS // 3, choice_1
    finish_0 = next(data for _, data in arrivals if b'"finish_reason":"stop"' in data)
    assert b'"system_fingerprint":"fp"' in finish_0  # still stamped from the usage chunk
    assert not any(b'"usage"' in data for _, data in arrivals)  # not asked for: stripped


async def test_the_backend_is_asked_for_identity_answers(
    start_served: StartServed, vllm_like: VllmLike
) -> None:
    proxy = start_served()
    request = json_request(
        "/v1/chat/completions",
        ONE_CHAT,
        None,
        {"Authorization": auth_header("high"), "Accept-Encoding": "gzip, br"},
    )
    assert (await exchange(proxy.host, proxy.port, request)).status == 200
    assert vllm_like.accept_encodings[-1] == "identity"  # aiohttp's default: "gzip, deflate"
