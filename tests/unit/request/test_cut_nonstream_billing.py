"""A non-stream request whose client leaves while the backend runs it is billed its prompt's
upper bound and its expected output (fresh eyes q03: it was billed 0 in the quota, the tpm bucket,
the usage log and the fairness charge, so closing just before the answer ran a tenant past its
quota); one that leaves while still queued is billed nothing.
The pipeline as the app wires it (a client that leaves cancels its handler), on the fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.routes import BY_ENDPOINT
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import SECRET, auth, make_config, until
from proxy.config.loader import parse_config
from proxy.policies.cost import weighted_tokens
from proxy.policies.tenants import VirtualTokenCounter
from proxy.server.state import ProxyState
from tests.helpers.bills import prompt_bound
from tests.helpers.clock import FakeClock
from tests.helpers.rig import tenants

TENANT = "tenant-normal"
TPM = 100_000
DAY = 1_000_000
MAX_TOKENS = 2000
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}


@contextlib.asynccontextmanager
async def rig(url: str, clock: FakeClock, records: list[dict[str, Any]]) -> AsyncIterator[Any]:
    limits = {"tokens_per_minute": TPM, "quota": {"tokens_per_day": DAY}}
    config = make_config([{"url": url, "max_inflight": 1}], tenants=tenants(**limits))
    state = ProxyState(parse_config(yaml.safe_dump(config), "test"), SECRET, clock)
    state.usage.sink = lambda line: records.append(orjson.loads(line))
    async with aiohttp.ClientSession() as session:
        state.session = session
        app = web.Application()
        app.router.add_post("/v1/chat/completions", state.pipeline.handler(BY_ENDPOINT["chat"]))
        state.dispatcher.start()
        try:
            server = TestServer(app, handler_cancellation=True)
            async with TestClient(server) as client:
                yield state, client
        finally:
            await state.dispatcher.stop()


def charged(state: ProxyState, clock: FakeClock) -> tuple[float, float, float]:
    """(the day quota's use, the tpm bucket's charge, the fairness counter) of the tenant."""
    quota = state.quota_book.usage(TENANT, {"tokens_per_day": DAY}, time.time())
    window = state.limits.windows(TENANT, clock())["tokens"]
    fairness = state.queue.fairness
    assert isinstance(fairness, VirtualTokenCounter)
    used: float = quota["tokens_per_day"]["used"]
    return used, window.limit - window.remaining, fairness.counter(TENANT)


def send(client: Any, **extra: Any) -> asyncio.Task[Any]:
    body = {**BODY, "max_tokens": MAX_TOKENS, **extra}
    return asyncio.create_task(
        client.post("/v1/chat/completions", json=body, headers=auth("normal"))
    )


async def leave_while(client: Any, ready: Any, **extra: Any) -> None:
    """Send BODY, leave (close the connection) once ``ready()`` holds."""
    post = send(client, **extra)
    await until(ready, 5, "the moment to leave")
    post.cancel()  # the client closes its connection: the proxy's handler is cancelled
    with contextlib.suppress(asyncio.CancelledError):
        await post


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_a_request_cut_while_the_backend_runs_it_is_billed(
    clock: FakeClock, stream: bool
) -> None:
    backend = FakeVLLM(usage=(7, 3))
    backend.gate.clear()  # the engine is working on it: no answer, no byte yet
    records: list[dict[str, Any]] = []
    async with backend.serve() as url, rig(url, clock, records) as (state, client):
        await leave_while(client, lambda: backend.active == 1, stream=stream)
        await until(lambda: backend.hung_up == 1, 5, "the proxy closing the upstream")
        await until(lambda: bool(records), 5, "the usage record")
        # A stream that delivered nothing yet: its prompt; a non-stream: its prompt and its
        # expected output (what the engine did before the abort is unknown).
        output = 0 if stream else MAX_TOKENS
        sent = {**BODY, "max_tokens": MAX_TOKENS, "stream": stream}
        prompt = prompt_bound(state.config, sent)  # its upper bound: never below vLLM's count
        tokens = prompt + output
        quota, tpm, fairness = charged(state, clock)
        # Before: the quota 0 (its reservation refunded), tpm its reservation (unknown usage).
        assert quota == tokens and tpm == tokens
        assert fairness == pytest.approx(weighted_tokens(prompt, output))
        (record,) = records
        assert record["outcome"] == "client_gone" and record["status"] == 499
        assert record["prompt_tokens"] == prompt
        assert record["completion_tokens"] == output
        assert record["usage_estimated"] is True
        assert record["usage_basis"] == ("delivered" if stream else "client_left")


async def test_a_request_cut_while_queued_is_billed_nothing(
    clock: FakeClock,
) -> None:
    backend = FakeVLLM(usage=(7, 3))
    backend.gate.clear()
    records: list[dict[str, Any]] = []
    async with backend.serve() as url, rig(url, clock, records) as (state, client):
        first = send(client)  # takes the backend's one slot
        await until(lambda: backend.active == 1, 5, "the first request at the backend")
        await leave_while(client, lambda: state.queue.depth("normal") == 1)
        await until(lambda: bool(records), 5, "the usage record")
        (cut,) = records
        assert cut["outcome"] == "client_gone" and cut["prompt_tokens"] == 0
        backend.gate.set()
        assert (await first).status == 200
        await until(lambda: len(records) == 2, 5, "the first one's record")
        quota, _, _ = charged(state, clock)
        assert quota == 10  # the first one's usage only (tpm keeps an unknown one's estimate)
