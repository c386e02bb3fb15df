"""The fuzz harness shared by the in-process fuzz (test_fuzz.py) and the served one
(served/test_fuzz_served.py): the config, the harness that sends generated cases through one
client session and records each answer, and the hypothesis driver (``TIERPROXY_FUZZ_CASES``
cases, ``BATCH`` per example)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from typing import Any

import aiohttp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.inproc import KEYS, auth, make_config, running_proxy, until
from proxy.server.state import ProxyState
from tests.helpers.answers import assert_openai_error, read_answer
from tests.helpers.fuzz_histogram import FUZZ, FuzzHistogram
from tests.helpers.fuzz_strategies import ClientCase, RawCase, client_cases, compress, raw_cases

FUZZ_CASES = int(os.environ.get("TIERPROXY_FUZZ_CASES", "10000"))
BATCH = 10
# A hang's guard, not a speed bar: a full run beside a benchmark took past 10 s to answer one
# case (the proxy and its client share this process's loop, niced beside the engines).
ANSWER_TIMEOUT_S = 30.0
AUTHORIZATION = f"Bearer {KEYS['low']}".encode()


def fuzz_config(backend_url: str, **extra: Any) -> dict[str, Any]:
    config = make_config(
        [{"url": backend_url}],
        # A body that never completes (a Content-Length the fuzz does not send) costs 0.5 s.
        input={"body_read_timeout_s": 0.5},
        server={"header_timeout_s": 2},
        **extra,
    )
    config["tiers"]["low"]["max_tokens"] = 100  # a capped tier: max_tokens null must pass
    return config


class Harness:
    """The proxy in front of a scripted backend, a client session, and the checks per case."""

    def __init__(self, histogram: FuzzHistogram = FUZZ) -> None:
        self.histogram = histogram
        self.stack = contextlib.AsyncExitStack()
        self.session: aiohttp.ClientSession
        self.base = ""
        self.host = "127.0.0.1"
        self.port = 0
        self.state: ProxyState

    async def start(self) -> None:
        backend_url = await self.stack.enter_async_context(FakeVLLM().serve())
        self.base, self.state = await self.stack.enter_async_context(
            running_proxy(fuzz_config(backend_url))
        )
        self.port = int(self.base.rsplit(":", 1)[1])
        self.session = await self.stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S))
        )

    async def stop(self) -> None:
        await self.stack.aclose()

    async def run(self, cases: list[ClientCase | RawCase]) -> None:
        for case in cases:
            if isinstance(case, RawCase):
                await self.raw(case)
            else:
                await self.client(case)

    async def client(self, case: ClientCase) -> None:
        headers = {**case.headers, **({} if "Authorization" in case.headers else auth("low"))}
        if case.encoding:
            headers["Content-Encoding"] = case.encoding
        data = compress(case.body, case.encoding, case.corrupt)
        async with self.session.request(
            case.method, self.base + case.path, data=data, headers=headers, allow_redirects=False
        ) as resp:
            raw = await resp.read()
        self.histogram.record("client", resp.status)
        assert resp.status < 500, (case, resp.status, raw[:300])
        if resp.status >= 300:
            assert_openai_error(resp.status, resp.content_type, raw)

    async def raw(self, case: RawCase) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(case.wire(AUTHORIZATION))
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                status, headers, body = await read_answer(reader)
        finally:
            writer.close()
        self.histogram.record("raw", status)
        assert status < 500, (case, status, body[:300])
        if status >= 400:
            assert_openai_error(status, headers.get(b"content-type", b"").decode(), body)

    async def nothing_held(self) -> None:
        state = self.state
        await until(
            lambda: (
                len(state.queue) == 0
                and all(b.inflight == 0 for b in state.pool.all())
                and state.limits.concurrent("tenant-low") == 0
                and state.budget.held == 0
            ),
            10,
            "every request's queue entry, backend slot, limit slot and held bytes released",
            state,
        )


def fuzz(harness: Harness, cases: int) -> None:
    """``cases`` fuzzed requests through ``harness`` (on one loop), then nothing held; fails on
    any 5xx or any error that is not OpenAI JSON."""
    histogram = harness.histogram
    started = time.perf_counter()
    with asyncio.Runner() as runner:
        runner.run(harness.start())
        try:

            @settings(
                max_examples=math.ceil(cases / BATCH),
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
                suppress_health_check=list(HealthCheck),
            )
            @given(cases=st.lists(client_cases | raw_cases, min_size=BATCH, max_size=BATCH))
            def batch(cases: list[Any]) -> None:
                runner.run(harness.run(cases))

            batch()
            runner.run(harness.nothing_held())
        finally:
            runner.run(harness.stop())
    histogram.seconds = time.perf_counter() - started
    histogram.write()
    assert histogram.cases() >= cases
    assert sum(n for status, n in histogram.statuses().items() if status >= 500) == 0
