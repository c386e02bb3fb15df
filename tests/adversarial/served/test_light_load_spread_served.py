"""The promise "a light load spreads over the backends" against `tierproxy serve` on its default
loop and default chooser (``least_utilised``), with two fake backends whose room differs by one
slot, as learned rooms do after a burst (red team, issue 32's stop): each request scored the
backend after taking it, so the larger room won every request of a light load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import NullBackend, ServedFleet
from proxy.bench.inproc import KEYS, make_config


@pytest.fixture
def fakes() -> Iterator[list[NullBackend]]:
    started = [NullBackend(FakeVLLM()).start() for _ in range(2)]
    try:
        yield started
    finally:
        for backend in started:
            backend.stop()


async def test_one_request_at_a_time_takes_turns_over_backends_of_unequal_room(
    tmp_path: Path, fakes: list[NullBackend]
) -> None:
    small, large = fakes
    backends: list[dict[str, Any]] = [
        {"url": small.url, "max_inflight": 8},
        {"url": large.url, "max_inflight": 9},
    ]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    request = json_request("/v1/chat/completions", body, KEYS["high"])
    with ServedFleet(tmp_path) as fleet:
        proxy = fleet.start(make_config(backends))
        for _ in range(10):
            resp = await exchange(proxy.host, proxy.port, request, timeout_s=30)
            assert resp.status == 200, resp.body[:300]
    # Before: (0, 10).
    assert (len(small.null.received), len(large.null.received)) == (5, 5)
