"""The memory budget reserves what a parsed body holds (#7 of the fresh-eyes report): a body
of tiny containers holds ~24x its bytes, and the flat 6x per byte let queued bodies take 4x
the budget; the reservation now comes from the body's shape (proxy.request.jsonshape)."""

from __future__ import annotations

import asyncio

import orjson

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import auth, make_config, until
from proxy.request.jsonshape import measure
from tests.helpers.clock import FakeClock
from tests.helpers.rig import BODY, error_of, rig

# 50,000 empty objects beside the chat (in a field that passes): 150 KB of JSON, ~3.6 MB parsed.
PADDED = {**BODY, "chat_template_kwargs": {"pad": [{}] * 50_000}}  # a field vLLM knows
RAW = orjson.dumps(PADDED)


async def test_a_body_of_tiny_containers_reserves_what_it_holds(clock: FakeClock) -> None:
    shape = measure(PADDED, max_depth=64, max_elements=10**9, max_containers=10**9)
    reserved = shape.held_bytes(RAW)
    assert reserved > 20 * len(RAW)  # 6x before: 0.9 MB for 3.6 MB held
    backend = FakeVLLM()
    async with backend.serve() as url:
        # Room for one such body and a half: the flat 6x let six of them queue.
        config = make_config([{"url": url}], limits={"max_held_bytes": reserved * 3 // 2})
        async with rig(config, clock) as r:
            backend.gate.clear()
            headers = {**auth("normal"), "Content-Type": "application/json"}

            async def send() -> int:
                resp = await r.client.post("/v1/chat/completions", data=RAW, headers=headers)
                await resp.read()
                return resp.status

            first = asyncio.create_task(send())
            await until(lambda: backend.active == 1, 5, "the first request at the backend")
            assert r.state.budget.held == reserved
            refused = await r.client.post("/v1/chat/completions", data=RAW, headers=headers)
            assert refused.status == 503
            assert (await error_of(refused))["code"] == "proxy_memory_full"
            backend.gate.set()
            assert await first == 200
            assert r.state.budget.held == 0
