"""The fuzz (tests/adversarial/test_fuzz.py) against `tierproxy serve` on its default loop
(uvloop, aiohttp's C parser): the same cases, never a 5xx, every error OpenAI JSON, nothing
left queued or in flight, and no traceback or "unhandled" line in its log.

``TIERPROXY_FUZZ_SERVED_CASES`` cases (default 10,000)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.served import (
    ADMIN_KEY,
    ServedProxy,
    ThreadedUpstream,
    admin_sections,
)
from tests.helpers.fuzz_histogram import SERVED_FUZZ
from tests.helpers.fuzzing import ANSWER_TIMEOUT_S, Harness, fuzz, fuzz_config

FUZZ_SERVED_CASES = int(os.environ.get("TIERPROXY_FUZZ_SERVED_CASES", "10000"))


class ServedHarness(Harness):
    """The fuzz's client side against a served proxy in front of the scripted backend (on a
    loop of its own: the served proxy reaches it between the fuzz's batches too)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(SERVED_FUZZ)
        self.workdir = workdir
        self.backend: ThreadedUpstream | None = None
        self.proxy: ServedProxy | None = None

    async def start(self) -> None:
        self.backend = ThreadedUpstream(FakeVLLM().app()).start()
        config = fuzz_config(self.backend.url, **admin_sections())
        self.proxy = ServedProxy(config, self.workdir)
        await asyncio.to_thread(self.proxy.start)
        assert self.proxy.on_default_loop()
        self.host, self.port, self.base = self.proxy.host, self.proxy.port, self.proxy.url
        self.session = await self.stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S))
        )

    async def stop(self) -> None:
        try:
            await self.stack.aclose()
        finally:
            if self.proxy is not None:
                self.proxy.stop()
            if self.backend is not None:
                self.backend.stop()

    async def nothing_held(self) -> None:
        assert self.proxy is not None
        deadline = time.monotonic() + 10
        while True:
            queued, inflight = await self._held()
            if queued == inflight == 0:
                break
            assert time.monotonic() < deadline, f"queued {queued}, in flight {inflight}"
            await asyncio.sleep(0.1)
        log = self.proxy.log_lines()
        assert self.proxy.tracebacks() == 0, "\n".join(log[-60:])
        assert self.proxy.count("unhandled") == 0, "\n".join(log[-60:])

    async def _held(self) -> tuple[float, float]:
        assert self.proxy is not None
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with self.session.get(f"{self.proxy.admin_url}/metrics", headers=headers) as resp:
            text = await resp.text()
        queued = inflight = 0.0
        for line in text.splitlines():
            if line.startswith("tierproxy_queue_depth{"):
                queued += float(line.rsplit(" ", 1)[1])
            elif line.startswith("tierproxy_backend_inflight{"):
                inflight += float(line.rsplit(" ", 1)[1])
        return queued, inflight


def test_fuzzed_requests_to_the_served_proxy_never_get_a_5xx(tmp_path: Path) -> None:
    fuzz(ServedHarness(tmp_path), FUZZ_SERVED_CASES)
