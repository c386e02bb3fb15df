"""vLLM's own numbers, read from its /metrics: samples keyed for the plugin scenarios, deltas,
histogram quantiles, and waits on its running / waiting gauges."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from proxy.bench.scrape import wait_idle
from proxy.telemetry import prometheus

RUNNING, WAITING = prometheus.VLLM_RUNNING, prometheus.VLLM_WAITING


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """vLLM's Prometheus samples, keyed by name plus the labels that matter here
    (``name|<le>`` for histogram buckets, ``name|<finished_reason>``), summed over the rest."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    samples: dict[str, float] = {}
    for sample in prometheus.samples(text, "vllm:"):
        key = sample.name
        for label in ("le", "finished_reason"):
            if label in sample.labels:
                key += f"|{sample.labels[label]}"
        samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def histogram_quantile(
    after: dict[str, float], before: dict[str, float], name: str, q: float
) -> tuple[float, int]:
    """(upper bound of the bucket holding quantile q, sample count) of a histogram's delta."""
    buckets = sorted(
        (float(k.split("|", 1)[1]), delta(after, before, k))
        for k in after
        if k.startswith(f"{name}_bucket|") and not k.endswith("+Inf")
    )
    total = int(delta(after, before, f"{name}_count"))
    if total == 0:
        raise AssertionError(f"no {name} samples")
    for bound, count in buckets:
        if count >= q * total:
            return bound, total
    return float("inf"), total


async def wait_gauges(
    session: aiohttp.ClientSession,
    url: str,
    *,
    running: int,
    waiting: int = 0,
    timeout_s: float = 30.0,
    while_pending: list[asyncio.Task[Any]] | None = None,
) -> bool:
    """Until vLLM's own gauges show ``running`` requests running and ``waiting`` waiting.

    The gauges come from the engine core's stats of each step, so this states what vLLM was
    doing, however late this client gets the CPU. False when not seen within ``timeout_s``, or
    once any of ``while_pending`` is done (the state can no longer appear).
    """
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:  # a starved API server may hold /metrics for seconds: give up at the deadline
            samples = await asyncio.wait_for(scrape(session, url), timeout=left)
        except TimeoutError:
            return False
        if samples.get(RUNNING, 0.0) >= running and samples.get(WAITING, 0.0) >= waiting:
            return True
        if while_pending and any(t.done() for t in while_pending):
            return False
        # Straight on to the next read, woken by its answer, not by a timer: on the loaded
        # VM this was measured on, a client timer (asyncio.sleep) often fired only when the
        # next socket event came, i.e. when the long low-tier answers arrived.
        await asyncio.sleep(0)
    return False


async def settle(session: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    """Until vLLM runs and holds nothing: the previous scenario's requests are gone."""
    if await wait_idle(session, url, timeout_s=timeout_s, poll_s=0.05) is None:
        raise AssertionError("vLLM did not become idle")
