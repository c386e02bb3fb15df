"""The client and the open loop against a fake OpenAI server on 127.0.0.1: outcomes, timings,
bounds. Fast: the fake answers at once (or never, for the timeout case, bounded by 0.3 s)."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.bench import results as results_file
from proxy.bench.cli import rerender
from proxy.bench.client import ClientSettings, send
from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.records import Outcome, PlannedRequest, RequestRecord
from proxy.bench.report import comparison, run_report
from proxy.bench.runner import RunSettings, check_fd_budget, run_plan
from proxy.bench.scenario import load_scenario


def _chunk(data: object) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _handler(request: web.Request, n: int) -> web.StreamResponse:
    body = await request.json()
    mode = body["messages"][0]["content"]
    assert request.headers["Authorization"].startswith("Bearer bench-")
    if mode in ("429", "503", "504", "400"):
        return web.json_response({"error": {"message": mode, "code": int(mode)}}, status=int(mode))
    if mode == "hang":
        await asyncio.sleep(5)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    for i in range(body["max_tokens"]):
        await resp.write(_chunk({"choices": [{"delta": {"content": f"t{i}"}}]}))
    if mode == "cut":
        return resp  # no [DONE]: the answer never became definitive
    if mode == "error-event":
        await resp.write(_chunk({"error": {"message": "request timed out", "code": 504}}))
    elif mode == "bad-event":
        await resp.write(_chunk({"error": {"message": "boom", "code": 500}}))
    else:
        await resp.write(
            _chunk(
                {
                    "choices": [],
                    "usage": {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]},
                }
            )
        )
    await resp.write(b"data: [DONE]\n\n")
    return resp


METRICS = 'tierproxy_queue_depth{tier="high"} 3.0\ntierproxy_queue_depth{tier="low"} 9.0\n'


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async with FakeVLLM(script=_handler, metrics_text=METRICS).serve() as url:
        yield url


def planned(mode: str, index: int = 0, at: float = 0.0, tier: str = "high") -> PlannedRequest:
    return PlannedRequest(
        index=index,
        at=at,
        tenant=f"t-{tier}",
        tier=tier,
        key=f"bench-t-{tier}-key",
        prompt=mode,
        max_tokens=5,
    )


@pytest.mark.parametrize(
    ("mode", "outcome"),
    [
        ("ok", Outcome.OK),
        ("429", Outcome.RATE_LIMITED),
        ("503", Outcome.UNAVAILABLE),
        ("504", Outcome.TIMEOUT),
        ("400", Outcome.ERROR),
        ("error-event", Outcome.TIMEOUT),
        ("bad-event", Outcome.ERROR),
        ("cut", Outcome.LOST),
    ],
)
async def test_outcomes(server: str, mode: str, outcome: Outcome) -> None:
    loop = asyncio.get_running_loop()
    settings = ClientSettings(base_url=server, model="m", t0=loop.time(), request_timeout_s=5)
    async with aiohttp.ClientSession() as session:
        rec = await send(session, planned(mode), settings)
    assert rec.outcome is outcome, rec.error
    assert rec.end is not None


async def test_ok_timings_and_usage(server: str) -> None:
    loop = asyncio.get_running_loop()
    settings = ClientSettings(base_url=server, model="m", t0=loop.time())
    async with aiohttp.ClientSession() as session:
        rec = await send(session, planned("ok"), settings)
    assert rec.status == 200
    assert rec.prompt_tokens == 7
    assert rec.output_tokens == 5
    assert len(rec.token_times) == 6  # the role chunk (with the first token in vLLM) + 5
    assert rec.ttft is not None and rec.e2e is not None
    assert 0 <= rec.ttft <= rec.e2e
    assert len(rec.itls) == 5


async def test_no_answer_in_time_is_lost(server: str) -> None:
    loop = asyncio.get_running_loop()
    settings = ClientSettings(base_url=server, model="m", t0=loop.time(), request_timeout_s=0.3)
    async with aiohttp.ClientSession() as session:
        rec = await send(session, planned("hang"), settings)
    assert rec.outcome is Outcome.LOST
    assert "0.3s (before a status)" in (rec.error or "")


async def test_refused_connection_is_an_error() -> None:
    loop = asyncio.get_running_loop()
    settings = ClientSettings(base_url="http://127.0.0.1:9", model="m", t0=loop.time())
    async with aiohttp.ClientSession() as session:
        rec = await send(session, planned("ok"), settings)
    assert rec.outcome is Outcome.ERROR


async def test_open_loop_sends_on_schedule_and_accounts_for_everything(server: str) -> None:
    modes = ["ok", "429", "503", "ok", "hang", "ok"]
    plan = [
        planned(m, index=i, at=0.02 * i, tier="high" if i % 2 else "low")
        for i, m in enumerate(modes)
    ]
    # The hanging request keeps the run open for 1.5 s: time for a few /metrics scrapes even
    # on a loaded machine.
    settings = RunSettings(
        label="proxy",
        base_url=server,
        model="m",
        request_timeout_s=1.5,
        drain_timeout_s=4.0,
        sample_interval_s=0.05,
    )
    result = await run_plan(plan, settings)
    assert [r.index for r in result.records] == list(range(len(plan)))
    outcomes = [r.outcome for r in result.records]
    assert outcomes == [
        Outcome.OK,
        Outcome.RATE_LIMITED,
        Outcome.UNAVAILABLE,
        Outcome.OK,
        Outcome.LOST,
        Outcome.OK,
    ]
    for p, r in zip(plan, result.records, strict=True):
        assert r.scheduled == p.at
        assert r.sent is not None
        assert r.sent >= p.at - 0.005  # never early
    # The run stops by itself: bounded by the request timeout plus the drain deadline (a bound
    # on termination, not a speed figure; slack for a loaded machine).
    assert settings.drain_timeout_s is not None
    assert result.wall_s < settings.request_timeout_s + settings.drain_timeout_s + 4.0
    assert any(s.queue_depth == {"high": 3.0, "low": 9.0} for s in result.samples)


async def test_drain_deadline_cancels_and_counts_lost(server: str) -> None:
    plan = [planned("hang", index=0), planned("ok", index=1, at=0.01)]
    settings = RunSettings(
        label="direct",
        base_url=server,
        model="m",
        request_timeout_s=600,
        drain_timeout_s=3.0,  # room for the other request to finish on a busy machine
        sample_interval_s=0.05,
    )
    result = await run_plan(plan, settings)
    assert result.records[0].outcome is Outcome.LOST
    assert "drain" in (result.records[0].error or "")
    assert result.records[1].outcome is Outcome.OK
    # The drain deadline, not the request timeout (200 times longer), ended it.
    assert result.wall_s < settings.request_timeout_s / 4
    # Nothing of the bench's is left running (the fake server's own handler may still be).
    assert not [t for t in asyncio.all_tasks() if "proxy/bench" in _where(t)]


def _where(task: asyncio.Task[object]) -> str:
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None)
    return "" if code is None else str(code.co_filename)


async def test_results_json_round_trip_and_rerender(server: str, tmp_path: Path) -> None:
    plan = [planned("ok", index=i, at=0.01 * i, tier="high" if i % 2 else "low") for i in range(6)]
    plan.append(planned("503", index=6, at=0.07))
    settings = RunSettings(label="proxy", base_url=server, model="m", sample_interval_s=0.05)
    result = await run_plan(plan, settings)
    scenario = load_scenario("seed-mixed")
    results = {"proxy": result}
    slos = {t: s for t in scenario.tiers if (s := scenario.slo_for(t))}
    reports = {"proxy": run_report(result, slos, scenario.tiers)}
    meta = results_file.RunMeta(model="m", seed=1, rate_rps=6.0, duration_s=0.07)
    path = results_file.write(
        tmp_path / "results.json",
        results_file.document(scenario, meta, results, reports, comparison(reports)),
    )
    assert rerender(path, with_plots=True) == 0
    assert (tmp_path / "ttft_cdf.png").exists()
    assert (tmp_path / "queue_depth.png").exists()
    again = orjson.loads(path.read_bytes())["runs"]["proxy"]["requests"]
    assert [RequestRecord.from_json(r).to_json() for r in again] == again
    assert reports["proxy"]["total"]["outcomes"]["503"] == 1
    assert reports["proxy"]["total"]["outcomes"]["ok"] == 6


def test_plan_larger_than_the_file_limit_is_refused() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    check_fd_budget(10)
    with pytest.raises(ValueError, match="open files"):
        check_fd_budget(soft)
