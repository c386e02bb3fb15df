"""The open loop: send every planned request at its time, whatever the answers do.

Bounded: the plan is finite and fixed in advance; every request has its own timeout; the drain
after the last send has a deadline; whatever is left then is cancelled and counted as lost.
Every task started here is owned here and cancelled on the way out, also on errors and Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from proxy.bench import scrape
from proxy.bench.client import ClientSettings, send
from proxy.bench.proxy_config import BENCH_ADMIN_KEY
from proxy.bench.records import Outcome, PlannedRequest, RequestRecord
from proxy.telemetry import prometheus


@dataclass(frozen=True)
class RunSettings:
    label: str  # "proxy" or "direct"
    base_url: str
    model: str
    request_timeout_s: float = 180.0
    drain_timeout_s: float | None = None  # after the last send; default request timeout + 15 s
    sample_interval_s: float = 0.5
    engine_url: str | None = None  # a vLLM to scrape for running/waiting (the direct target)
    run_id: str = "bench"
    metrics_key: str | None = BENCH_ADMIN_KEY  # for the target's /metrics (a proxy's wants one)


@dataclass
class Sample:
    """A look at the system every sample interval."""

    t: float
    inflight: dict[str, int]  # per tier, from the client's side: sent, not answered
    queue_depth: dict[str, float] | None  # per tier, the proxy's tierproxy_queue_depth
    engine_running: float | None
    engine_waiting: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 3),
            "inflight": self.inflight,
            "queue_depth": self.queue_depth,
            "engine_running": self.engine_running,
            "engine_waiting": self.engine_waiting,
        }


@dataclass
class RunStatus:
    label: str
    elapsed: float
    duration: float
    planned: int
    sent: int
    inflight: int
    counts: Counter[str] = field(default_factory=Counter)


class ProgressSink(Protocol):
    def update(self, status: RunStatus) -> None: ...

    def close(self, status: RunStatus) -> None: ...


@dataclass
class RunResult:
    label: str
    base_url: str
    records: list[RequestRecord]
    samples: list[Sample]
    planned_duration: float
    wall_s: float


async def run_plan(
    plan: Sequence[PlannedRequest],
    settings: RunSettings,
    progress: ProgressSink | None = None,
) -> RunResult:
    """Run ``plan`` open-loop against ``settings.base_url``; one record per planned request."""
    duration = max((p.at for p in plan), default=0.0)
    check_fd_budget(len(plan))
    drain_s = settings.drain_timeout_s
    if drain_s is None:
        drain_s = settings.request_timeout_s + 15.0
    # One connection per outstanding request, never a client-side pool queue: a request held
    # back here would be invisible to the proxy's scheduler (a high-tier request could wait
    # behind low-tier ones in our pool) and would not be an open loop any more.
    # A fresh connection per request: a pooled keep-alive connection that the server is
    # closing as it is reused fails with "Server disconnected", which is a client artefact.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    records: dict[int, RequestRecord] = {}
    tasks: dict[asyncio.Task[RequestRecord], PlannedRequest] = {}
    inflight: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    samples: list[Sample] = []
    t0 = time.monotonic()
    client = ClientSettings(
        base_url=settings.base_url,
        model=settings.model,
        t0=t0,
        request_timeout_s=settings.request_timeout_s,
        run_id=settings.run_id,
    )

    def status() -> RunStatus:
        return RunStatus(
            label=settings.label,
            elapsed=time.monotonic() - t0,
            duration=duration,
            planned=len(plan),
            sent=len(tasks) + len(records),
            inflight=sum(inflight.values()),
            counts=Counter(counts),
        )

    def finished(task: asyncio.Task[RequestRecord]) -> None:
        planned = tasks.pop(task)
        inflight[planned.tier] -= 1
        if task.cancelled():
            rec = _lost(planned, "cancelled at the drain deadline")
        elif task.exception() is not None:
            rec = _lost(planned, f"bench bug: {task.exception()!r}")
        else:
            rec = task.result()
        records[planned.index] = rec
        counts[rec.outcome.value] += 1

    async with aiohttp.ClientSession(connector=connector) as session:
        sampler = asyncio.create_task(
            _sample(session, settings, t0, inflight, samples, status, progress)
        )
        try:
            for planned in plan:
                delay = t0 + planned.at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(send(session, planned, client))
                tasks[task] = planned
                inflight[planned.tier] += 1
                task.add_done_callback(finished)
            if tasks:
                await asyncio.wait(set(tasks), timeout=drain_s)
        finally:
            leftovers = list(tasks)
            for task in leftovers:
                task.cancel()
            sampler.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*leftovers, sampler, return_exceptions=True), timeout=10.0
                )
            if progress is not None:
                progress.close(status())
    # Requests never sent (the run was interrupted) are lost as well: one record per plan entry.
    ordered = [records.get(p.index) or _lost(p, "never sent (run interrupted)") for p in plan]
    return RunResult(
        label=settings.label,
        base_url=settings.base_url,
        records=ordered,
        samples=samples,
        planned_duration=duration,
        wall_s=time.monotonic() - t0,
    )


def check_fd_budget(outstanding: int) -> None:
    """Each outstanding request holds a socket: refuse a plan the file limit cannot hold."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and outstanding + 256 > soft:
        raise ValueError(
            f"the plan has {outstanding} requests but only {soft} open files are allowed: "
            "raise `ulimit -n` or shorten the run"
        )


def _lost(planned: PlannedRequest, why: str) -> RequestRecord:
    return RequestRecord(
        index=planned.index,
        tenant=planned.tenant,
        tier=planned.tier,
        scheduled=planned.at,
        outcome=Outcome.LOST,
        error=why,
    )


@dataclass
class _Scraped:
    """The latest values read from /metrics (they may lag the client-side counts a little)."""

    depth: dict[str, float] | None = None
    running: float | None = None
    waiting: float | None = None


async def _sample(
    session: aiohttp.ClientSession,
    settings: RunSettings,
    t0: float,
    inflight: Counter[str],
    samples: list[Sample],
    status: Any,
    progress: ProgressSink | None,
) -> None:
    """Every sample interval: in-flight per tier, the proxy's queue depth, vLLM's queue.

    Scraping runs in its own task, so that a slow /metrics under load never delays the
    client-side samples or the progress bar.
    """
    latest = _Scraped()
    scraper = asyncio.create_task(_scrape(session, settings, latest))
    try:
        while True:
            samples.append(
                Sample(
                    t=time.monotonic() - t0,
                    inflight={k: v for k, v in inflight.items() if v},
                    queue_depth=latest.depth,
                    engine_running=latest.running,
                    engine_waiting=latest.waiting,
                )
            )
            if progress is not None:
                progress.update(status())
            await asyncio.sleep(settings.sample_interval_s)
    finally:
        scraper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraper


async def _scrape(session: aiohttp.ClientSession, settings: RunSettings, latest: _Scraped) -> None:
    engine_url = settings.engine_url
    target_alive = True
    target_seen = False
    failures = 0
    while True:
        want_engine = engine_url is not None and engine_url != settings.base_url
        target_text, engine_text = await asyncio.gather(
            scrape.fetch_metrics(session, settings.base_url, key=settings.metrics_key)
            if target_alive
            else _none(),
            scrape.fetch_metrics(session, engine_url) if want_engine and engine_url else _none(),
        )
        if target_alive and target_text is None:
            failures += 1
            if not target_seen and failures >= 3:
                target_alive = False  # this target has no /metrics: stop asking
        elif target_text is not None:
            target_seen = True
            depth = prometheus.sum_by(target_text, prometheus.PROXY_QUEUE_DEPTH, "tier")
            latest.depth = depth or None
        if engine_url == settings.base_url:
            engine_text = target_text
        if engine_text is not None:
            latest.running = prometheus.total(engine_text, prometheus.VLLM_RUNNING)
            latest.waiting = prometheus.total(engine_text, prometheus.VLLM_WAITING)
        await asyncio.sleep(settings.sample_interval_s)


async def _none() -> None:
    return None
