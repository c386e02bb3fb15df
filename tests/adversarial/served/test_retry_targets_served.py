"""The promise "a request is never lost and never run twice" against `tierproxy serve` on its
default loop, with two fake backends (``FakeVLLM``), one of them failing. A failure before any
byte reached the client is retried on another backend, never on the one that just failed while
another can serve (README "Limits and timeouts", docs/adversarial.md).

Found by a red team (issue 31), each fixed since, the faults as they were:

F1: the tokenizer routes (``/tokenize``, ``/detokenize``) take their lease without the queue
(``proxy.request.leases.direct_lease``): ``BackendPool.acquire_cheap`` ignores the backends the
request already failed on, so the retry goes back to the first backend of the config. A reset
there twice: the client got ``502 upstream_reset`` ("broke the connection to 2 backends": one
backend, twice) while the second backend never saw the call.

F2: a backend whose connection times out (a host gone: its SYNs dropped) raises aiohttp's
``ConnectionTimeoutError``, a ``TimeoutError``: the relay answers it as the tier's execution
timeout (``504 request_timeout`` "did not finish within its tier's limit of 120s", after the 1 s
connect timeout), never retried on the healthy backend and never counted against the dead one,
so every request placed there until its health probes fail gets the same 504.

F3: a wedged backend (its ``/health`` answers, as vLLM's does while its engine is alive but
stuck; its generations never answer) is never counted as failing: each request there ends in
the tier's ``504 request_timeout`` (``x-should-retry: false``) and the next one, the backends all
idle again, goes to the same backend (ties break by config order). Six requests in a row: six
504s, the healthy backend served none, and no line in the log says why.

F4: an engine core that dies while its backend is idle (vLLM's API server then answers every
POST with EngineDeadError's 500 and ``/health`` fails) is known to the proxy only through its
failed probes, which ``proxy.request.poison.blame`` does not read: the next request, alone
there, is called the poison pill (``502 engine_dead`` "died while running this request alone;
not retried") though the engine died a second before it arrived and the other backend is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import exchange, json_request, request_bytes
from proxy.bench.hostile.served import (
    ADMIN_KEY,
    NullBackend,
    ServedFleet,
    ServedProxy,
    admin_sections,
)
from proxy.bench.inproc import KEYS, make_config
from tests.helpers.timing import polls_until


@pytest.fixture
def served_over(tmp_path: Path) -> Iterator[Any]:
    """Served proxies in front of the given backends (the first request goes to the first
    backend, all idle; ``least_utilised`` breaks later ties by rotation); stopped at
    teardown."""
    with ServedFleet(tmp_path) as fleet:

        def start(backends: list[dict[str, Any]], **sections: Any) -> ServedProxy:
            return fleet.start(make_config(backends, **admin_sections(), **sections))

        yield start


@contextlib.contextmanager
def backends(*fakes: FakeVLLM) -> Iterator[list[NullBackend]]:
    started = [NullBackend(fake).start() for fake in fakes]
    try:
        yield started
    finally:
        for backend in started:
            backend.stop()


def tokenize() -> bytes:
    return json_request("/tokenize", {"model": "tiny", "prompt": "hello"}, KEYS["low"])


def chat(*, stream: bool = False) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if stream:
        body["stream"] = True
    return json_request("/v1/chat/completions", body, KEYS["low"])


async def _reset(request: web.Request, n: int) -> web.StreamResponse | None:
    """The connection drops once the request is in (vLLM's process killed under it)."""
    assert request.transport is not None
    request.transport.abort()
    return web.Response()


async def test_a_tokenizer_call_reset_by_one_backend_is_answered_by_the_other(
    served_over: Any,
) -> None:
    with backends(FakeVLLM(script=_reset), FakeVLLM()) as (bad, good):
        proxy = served_over([{"url": bad.url}, {"url": good.url}])
        resp = await exchange(proxy.host, proxy.port, tokenize(), timeout_s=20)
        # Before: 502 upstream_reset, the first backend called twice, the second never.
        assert (len(bad.null.received), len(good.null.received)) == (1, 1), resp.body[:300]
        assert resp.status == 200, resp.body[:300]
        assert orjson.loads(resp.body)["count"] == 2


async def test_a_tokenizer_call_refused_with_503_is_never_retried_on_the_same_backend(
    served_over: Any,
) -> None:
    with backends(FakeVLLM(tokenize_status=503), FakeVLLM()) as (bad, good):
        proxy = served_over([{"url": bad.url}, {"url": good.url}])
        resp = await exchange(proxy.host, proxy.port, tokenize(), timeout_s=20)
        assert resp.status == 200, resp.body[:300]
        # Before: the busy backend got the call twice (attempts 1 and 2) before the other one.
        assert len(bad.null.received) == 1
        assert len(good.null.received) == 1


@contextlib.contextmanager
def host_gone() -> Iterator[str]:
    """A backend URL whose connections never open: a listener with its accept queue full (the
    kernel then drops each new SYN, as for a host that went away)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        probe = socket.create_connection  # a new connection must not open now
        with pytest.raises(OSError):
            probe(("127.0.0.1", port), timeout=0.5).close()
        yield f"http://127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        server.close()


async def test_a_backend_whose_connect_times_out_is_passed_over(served_over: Any) -> None:
    with host_gone() as gone, backends(FakeVLLM()) as (good,):
        # Its probes never mark it down within the test (a busy machine's slow start must not
        # let them do it before the request comes): what is tested is the request's path.
        health = {"connect_timeout_s": 1.0, "unhealthy_after": 1000}
        proxy = served_over([{"url": gone}, {"url": good.url}], backend_health=health)
        # The first request goes to the first backend (all idle): the one that is gone.
        resp = await exchange(proxy.host, proxy.port, chat(), timeout_s=60)
        # Before: 504 request_timeout ("did not finish within its tier's limit of 120s") after
        # the 1 s connect timeout; the healthy backend never saw it.
        assert resp.status == 200, resp.body[:300]
        assert len(good.null.received) == 1
        assert proxy.count(r"unavailable \(connect") >= 1  # counted against the dead one


async def _wedged(request: web.Request, n: int) -> web.StreamResponse | None:
    await asyncio.sleep(3600)  # the engine never answers; its /health still does
    return None


async def test_a_wedged_backend_stops_getting_requests_after_its_timeouts(
    served_over: Any,
) -> None:
    with backends(FakeVLLM(script=_wedged), FakeVLLM()) as (bad, good):
        tiers = {"low": {"request_timeout_s": 2}}
        proxy = served_over([{"url": bad.url}, {"url": good.url}], tiers=tiers)
        statuses = []
        for _ in range(6):
            # Streams: vLLM sends a stream's head as soon as it takes the request, so one with
            # no head within the tier's limit is the backend's failure. A non-streamed answer's
            # head comes with its end: its timeout says nothing of the backend (not counted).
            request = chat(stream=True)
            statuses.append((await exchange(proxy.host, proxy.port, request, timeout_s=30)).status)
        # Before: [504] * 6, all six on the wedged backend. Passive ejection takes a backend out
        # after two failures in a row (resets, 5xx, streams without a head): two 504s at most.
        assert statuses.count(504) <= 2, statuses
        assert proxy.count(r"sent no answer head") == statuses.count(504)
        assert len(good.null.received) >= 4, (len(bad.null.received), statuses)


async def test_a_request_reaching_an_engine_that_died_idle_is_served_elsewhere(
    served_over: Any,
) -> None:
    with backends(FakeVLLM(), FakeVLLM()) as (dies, other):
        # Probes every 0.2 s, none of them enough alone to mark it down within the test.
        health = {"health_interval_s": 0.2, "unhealthy_after": 1000}
        proxy = served_over([{"url": dies.url}, {"url": other.url}], backend_health=health)
        warm = await exchange(proxy.host, proxy.port, chat(), timeout_s=20)
        assert warm.status == 200 and len(dies.null.received) == 1  # the first one, all idle
        dies.null.dead = True  # its engine core dies while nothing runs there

        async def probes_failed() -> bool:  # two: the first's mark is set by the second's count
            metrics = request_bytes("GET", "/metrics", {"Authorization": f"Bearer {ADMIN_KEY}"})
            resp = await exchange(proxy.host, proxy.admin_port or proxy.port, metrics)
            return any(
                line.startswith("tierproxy_backend_probe_failures_total{")
                and 'probe="health"' in line
                and dies.url in line
                and float(line.rsplit(" ", 1)[1]) >= 2
                for line in resp.body.decode().splitlines()
            )

        # Counted by the proxy, not slept on: a busy host's proxy probed too few times in 1 s.
        await polls_until(probes_failed, 600, "the dead engine's /health probes to fail")
        resp = await exchange(proxy.host, proxy.port, chat(), timeout_s=20)
        # Before: 502 engine_dead, the request called a poison pill; the other backend idle.
        assert resp.status == 200, resp.body[:300]
        assert len(other.null.received) == 1
        assert proxy.count(r"not retried \(poison pill\)") == 0


async def test_a_request_whose_connect_outlasts_the_tiers_limit_is_billed_nothing(
    served_over: Any, tmp_path: Path
) -> None:
    """Fresh eyes, 2026-12-06: a non-stream request cut by its tier's limit is billed its
    reservation (vLLM ran it: its head comes only with its end), but one whose connect was
    still hanging (a host gone, the tier's limit under ``connect_timeout_s``) reached no
    engine: it was billed 151 + 900 tokens. Only a request whose head was sent is billed."""
    log = tmp_path / "usage.jsonl"
    with host_gone() as gone:
        health = {"connect_timeout_s": 30.0, "unhealthy_after": 1000}
        proxy = served_over(
            [{"url": gone}],
            backend_health=health,
            tiers={"low": {"request_timeout_s": 1}},
            usage_log={"path": str(log)},
        )
        resp = await exchange(proxy.host, proxy.port, chat(), timeout_s=60)
        assert resp.status == 504, resp.body[:300]
        for _ in range(200):  # the usage line is written as the request ends
            if log.exists() and log.read_bytes().strip():
                break
            await asyncio.sleep(0.05)
    (record,) = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert record["usage_basis"] == "none", record
    assert (record["prompt_tokens"], record["completion_tokens"]) == (0, 0), record
